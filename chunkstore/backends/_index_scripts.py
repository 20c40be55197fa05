"""The capacity index's Lua scripts: each change to a store's index is one atomic script.

KEYS name a store's hashes, sorted sets and stream (usage, lru, sizes, reserved, feed; meta
for the stale mark).
:mod:`chunkstore.backends._index` registers and calls them.

Each script that puts a chunk into the LRU order appends ``s <name>`` to the store's change
feed, and each that takes one out appends ``r <name>``: what
:class:`~chunkstore.backends._feed.ChangeFeed` reads.
"""

FEED_LENGTH = 100_000
"""Entries a store's change feed keeps, about (Redis trims whole nodes of the stream)."""

# Shared by the scripts below (KEYS: usage, lru, sizes, reserved, feed): appends to the change
# feed, and takes one chunk out of the index, returning the bytes it held.
_ANNOUNCE = f"""
local function announce(feed, kind, name)
  redis.call('XADD', feed, 'MAXLEN', '~', {FEED_LENGTH}, '*', kind, name)
end
"""

TAKE_OUT = (
    _ANNOUNCE
    + """
local function take_out(name)
  local freed = tonumber(redis.call('HGET', KEYS[3], name) or '0')
  redis.call('ZREM', KEYS[2], name)
  redis.call('ZREM', KEYS[4], name)
  redis.call('HDEL', KEYS[3], name)
  redis.call('HINCRBY', KEYS[1], 'bytes', -freed)
  redis.call('HINCRBY', KEYS[1], 'chunks', -1)
  announce(KEYS[5], 'r', name)
  return freed
end
"""
)

# KEYS: usage, lru, sizes, reserved, feed. ARGV: member, size, now, cap (-1: none), max
# victims, mode.
# Accounts a chunk just published, or (mode 'reserve') about to be: new, or replacing one
# of another size. Then takes the least recently used others out of the index until usage
# fits the cap. Returns 1 if the entry is new (0 if the index had it), then the victims:
# the caller deletes their files. A reserved chunk is counted but out of the LRU order
# until its publish commits it, so no writer evicts a chunk that is not on disk yet; the
# reserved set holds when it was reserved, so a reconcile leaves it alone while it is young.
ADD = (
    TAKE_OUT
    + """
local old = redis.call('HGET', KEYS[3], ARGV[1])
local size = tonumber(ARGV[2])
if old then
  redis.call('HINCRBY', KEYS[1], 'bytes', size - tonumber(old))
else
  redis.call('HINCRBY', KEYS[1], 'bytes', size)
  redis.call('HINCRBY', KEYS[1], 'chunks', 1)
end
redis.call('HSET', KEYS[3], ARGV[1], size)
if ARGV[6] == 'reserve' then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
else
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  announce(KEYS[5], 's', ARGV[1])
end
local cap = tonumber(ARGV[4])
local out = {old and 0 or 1}
if cap < 0 then return out end
local used = tonumber(redis.call('HGET', KEYS[1], 'bytes'))
while used > cap and #out <= tonumber(ARGV[5]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 1)
  local pick = oldest[1]
  if pick == ARGV[1] then pick = oldest[2] end
  if not pick then break end
  used = used - take_out(pick)
  out[#out + 1] = pick
end
return out
"""
)

# KEYS: usage, lru, sizes, reserved, feed. ARGV: member, size, last use, then the next
# chunk's three, ... Adds each chunk a walk found, unless the index has it (a writer
# accounted it meanwhile: then only puts it into the LRU order if it is not there). A chunk
# found on disk is no longer waiting for its publish. Returns how many it added.
ADD_FOUND = (
    TAKE_OUT
    + """
local added, bytes = 0, 0
for i = 1, #ARGV, 3 do
  redis.call('ZREM', KEYS[4], ARGV[i])
  if redis.call('HEXISTS', KEYS[3], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], 'NX', ARGV[i + 2], ARGV[i])
  else
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    redis.call('ZADD', KEYS[2], ARGV[i + 2], ARGV[i])
    added = added + 1
    bytes = bytes + tonumber(ARGV[i + 1])
    announce(KEYS[5], 's', ARGV[i])
  end
end
if added > 0 then
  redis.call('HINCRBY', KEYS[1], 'bytes', bytes)
  redis.call('HINCRBY', KEYS[1], 'chunks', added)
end
return added
"""
)

# KEYS: lru, sizes, reserved, feed. ARGV: member, now. Puts a published chunk (reserved
# before) into the LRU order, if the index still counts it.
COMMIT = (
    _ANNOUNCE
    + """
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
  announce(KEYS[4], 's', ARGV[1])
end
return 0
"""
)

# KEYS: usage, lru, sizes, reserved, feed. ARGV: members. Takes chunks out; returns how many it
# held.
REMOVE = (
    TAKE_OUT
    + """
local taken = 0
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[3], ARGV[i]) == 1 then
    take_out(ARGV[i])
    taken = taken + 1
  end
end
return taken
"""
)

# KEYS: usage, lru, sizes, reserved, feed. ARGV: cap, max victims, oldest last use kept (-1: any).
# Takes out the least recently used chunks while usage is over the cap or their last use is
# older.
EVICT = (
    TAKE_OUT
    + """
local cap = tonumber(ARGV[1])
local before = tonumber(ARGV[3])
local victims = {}
local used = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
while #victims < tonumber(ARGV[2]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local pick = oldest[1]
  if not pick then break end
  local over = cap >= 0 and used > cap
  local stale = before >= 0 and tonumber(oldest[2]) < before
  if not over and not stale then break end
  used = used - take_out(pick)
  victims[#victims + 1] = pick
end
return victims
"""
)

# KEYS: usage, lru, sizes, reserved, feed. ARGV: the oldest reservation kept (seconds), members.
# Takes out the chunks a reconcile found no file of, but for those reserved at or after that
# time: their writers may still be writing the temp file. Returns how many it took out.
REMOVE_GONE = (
    TAKE_OUT
    + """
local kept = tonumber(ARGV[1])
local taken = 0
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[3], ARGV[i]) == 1 then
    local since = redis.call('ZSCORE', KEYS[4], ARGV[i])
    if not since or tonumber(since) < kept then
      take_out(ARGV[i])
      taken = taken + 1
    end
  end
end
return taken
"""
)

# KEYS: meta. ARGV: the stale mark a full reconcile saw when it began ('' if none). Clears
# the mark unless a writer set it anew meanwhile (its writes may lie in walked directories).
CLEAR_STALE = """
if (redis.call('HGET', KEYS[1], 'stale') or '') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'stale')
  return 1
end
return 0
"""
