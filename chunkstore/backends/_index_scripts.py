"""The capacity index's Lua scripts: each change to a store's index is one atomic script.

KEYS name a store's hashes, sets and stream (usage, lru, sizes, reserved, feed, records, then
credit and writers for the scripts that reserve room; meta for the stale mark).
:mod:`chunkstore.backends._index` registers and calls them.

Each script that puts a chunk into the LRU order appends ``s <name>`` to the store's change
feed (a writer's account adds ``d <link>``, the chunk's parent digest and token bytes), and
each that takes one out appends ``r <name>``: what
:class:`~chunkstore.backends._feed.ChangeFeed` reads. ``reserved`` holds the reservations
of writers that follow an earlier reading of spec 6.8 (one per chunk); this library's
writers reserve room as credit instead, and the scripts still honour both. ``records``
holds the chunks whose files have an access record a reader told the index of: a step that
takes chunks out returns, after the victims, a string of ``1`` (the victim had one) and
``0``, one per victim.
"""

FEED_LENGTH = 100_000
"""Entries a store's change feed keeps, about (Redis trims whole nodes of the stream)."""

# Shared by the scripts below (KEYS: usage, lru, sizes, reserved, feed, records): appends to
# the change feed, and takes one chunk out of the index, returning the bytes it held and '1'
# if the index knew of an access record beside its file ('0' if not).
_ANNOUNCE = f"""
local function announce(feed, kind, name, link)
  if link and link ~= '' then
    redis.call('XADD', feed, 'MAXLEN', '~', {FEED_LENGTH}, '*', kind, name, 'd', link)
  else
    redis.call('XADD', feed, 'MAXLEN', '~', {FEED_LENGTH}, '*', kind, name)
  end
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
  redis.call('HINCRBY', KEYS[1], 'bytes', 0 - freed)
  redis.call('HINCRBY', KEYS[1], 'chunks', -1)
  announce(KEYS[5], 'r', name)
  return freed, tostring(redis.call('SREM', KEYS[6], name))
end
"""
)

# Shared by the scripts below (KEYS as theirs, credit and writers 7th and 8th): the credit
# of writers last seen before a time is given back (they are taken as dead), and chunks are
# evicted while what is counted, accounted bytes and credit, exceeds a cap: the caller's
# leading values, the victims, then their records string.
_CREDIT = """
local function reclaim(before)
  local dead = redis.call('ZRANGEBYSCORE', KEYS[8], '-inf', '(' .. before, 'LIMIT', 0, 100)
  for _, writer in ipairs(dead) do
    local held = tonumber(redis.call('HGET', KEYS[7], writer) or '0')
    redis.call('HINCRBY', KEYS[1], 'credit', 0 - held)  -- not -held: Lua writes -0 as '-0'
    redis.call('HDEL', KEYS[7], writer)
    redis.call('ZREM', KEYS[8], writer)
  end
  return #dead
end

local function counted()
  local raw = redis.call('HMGET', KEYS[1], 'bytes', 'credit')
  return tonumber(raw[1] or '0') + tonumber(raw[2] or '0')
end

local function evict_to(cap, most, victims)
  local records = {}
  if cap >= 0 then
    local used = counted()
    local before = #victims  -- the caller's own leading values are no victims
    while used > cap and #victims - before < most do
      local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
      if not oldest[1] then break end
      local freed, had = take_out(oldest[1])
      used = used - freed
      victims[#victims + 1] = oldest[1]
      records[#records + 1] = had
    end
  end
  victims[#victims + 1] = table.concat(records)
  return victims
end

local function now_on_server()
  local time = redis.call('TIME')
  return tonumber(time[1]) + tonumber(time[2]) / 1e6
end
"""

# KEYS: usage, lru, sizes, reserved, feed, records, credit, writers. ARGV: writer (empty: none), cap
# (-1: none), max victims, now (the first chunk's last use), then name, size, credit drawn and
# link (the parent digest and token bytes for the feed's ``d``; empty: none) for each chunk.
# Accounts chunks just published: each is new, or replaces one of another size, and goes
# into the LRU order. The credit each drew (when the writer reserved its room ahead) comes
# off the writer's credit, so what is counted stays what is on disk plus what is reserved.
# A writer whose credit was given back meanwhile draws nothing: its chunks count in full,
# and least recently used chunks are evicted while the count exceeds the cap. Returns 1 if
# the writer's credit was short (it had been given back), a string of '1' (new) and '0'
# (the index had it) per chunk, then the victims and their records string: the caller
# deletes their files.
ACCOUNT = (
    TAKE_OUT
    + _CREDIT
    + """
local writer = ARGV[1]
local have = -1
if writer ~= '' then have = tonumber(redis.call('HGET', KEYS[7], writer) or '-1') end
local short, new, bytes, chunks, drawn = 0, {}, 0, 0, 0
for i = 5, #ARGV, 4 do
  local name, size, draw = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local old = redis.call('HGET', KEYS[3], name)
  if old then
    bytes = bytes + size - tonumber(old)
    new[#new + 1] = '0'
  else
    bytes = bytes + size
    chunks = chunks + 1
    new[#new + 1] = '1'
  end
  redis.call('HSET', KEYS[3], name, size)
  -- a microsecond apart, so the LRU order within one call is the order accounted
  redis.call('ZADD', KEYS[2], tonumber(ARGV[4]) + (i - 5) / 4 * 1e-6, name)
  redis.call('ZREM', KEYS[4], name)
  announce(KEYS[5], 's', name, ARGV[i + 3])
  if draw > 0 then
    if draw > have then
      short = 1
      draw = math.max(have, 0)
    end
    have = have - draw
    drawn = drawn + draw
  end
end
redis.call('HINCRBY', KEYS[1], 'bytes', bytes)
redis.call('HINCRBY', KEYS[1], 'chunks', chunks)
if drawn > 0 then redis.call('HINCRBY', KEYS[1], 'credit', 0 - drawn) end
if have >= 0 then
  redis.call('HSET', KEYS[7], writer, have)
  redis.call('ZADD', KEYS[8], now_on_server(), writer)
end
return evict_to(tonumber(ARGV[2]), tonumber(ARGV[3]), {short, table.concat(new)})
"""
)

# KEYS: usage, lru, sizes, reserved, feed, records, credit, writers. ARGV: writer, bytes wanted,
# bytes needed, cap, max victims, grace (seconds), most credit all writers may hold. Gives back
# the credit of writers not seen for the grace (by the server's clock), then reserves room for the
# writer's next chunks: what it wants while all writers' credit stays within the most, else what
# it needs. The room is counted, and least recently used chunks are taken out while the count
# exceeds the cap; where no victim is left to make the room (or more are needed than max victims),
# less is reserved, down to what is needed. Returns the bytes reserved, then the victims and their
# records string: the writer deletes their files before it publishes into that room.
CREDIT = (
    TAKE_OUT
    + _CREDIT
    + """
local now = now_on_server()
reclaim(now - tonumber(ARGV[6]))
local held = tonumber(redis.call('HGET', KEYS[1], 'credit') or '0')
local room = tonumber(ARGV[7]) - held
local grant = math.max(tonumber(ARGV[3]), math.min(tonumber(ARGV[2]), room))
redis.call('HINCRBY', KEYS[7], ARGV[1], grant)
redis.call('HINCRBY', KEYS[1], 'credit', grant)
redis.call('ZADD', KEYS[8], now, ARGV[1])
local out = evict_to(tonumber(ARGV[4]), tonumber(ARGV[5]), {grant})
-- No victim left to make the room (or too many needed): grant less, down to what is needed.
local over = counted() - tonumber(ARGV[4])
if tonumber(ARGV[4]) >= 0 and over > 0 then
  local cut = math.min(over, grant - tonumber(ARGV[3]))
  if cut > 0 then
    redis.call('HINCRBY', KEYS[7], ARGV[1], 0 - cut)
    redis.call('HINCRBY', KEYS[1], 'credit', 0 - cut)
    out[1] = grant - cut
  end
end
return out
"""
)

# KEYS: usage, lru, sizes, reserved, feed, records, credit, writers. ARGV: writer. Gives
# back what is left of a writer's credit (it closes). Returns the bytes given back.
GIVE_BACK = """
local held = tonumber(redis.call('HGET', KEYS[7], ARGV[1]) or '0')
redis.call('HINCRBY', KEYS[1], 'credit', 0 - held)  -- not -held: Lua writes -0 as '-0'
redis.call('HDEL', KEYS[7], ARGV[1])
redis.call('ZREM', KEYS[8], ARGV[1])
return held
"""

# KEYS: usage, lru, sizes, reserved, feed, records, credit, writers. ARGV: grace (seconds).
# Gives back the credit of writers not seen for the grace (a reconcile's step). Returns how many.
RECLAIM = (
    TAKE_OUT
    + _CREDIT
    + """
return reclaim(now_on_server() - tonumber(ARGV[1]))
"""
)

# KEYS: usage, lru, sizes, reserved, feed, records. ARGV: member, size, last use, has an
# access record ('1' or '0'), then the next chunk's four, ... Adds each chunk a walk found,
# unless the index has it (a writer accounted it meanwhile: then only puts it into the LRU
# order if it is not there), and notes the records found. A record the walk did not see is
# not un-noted: a reader may have written it since, and a note too many costs one unlink.
# A chunk found on disk is no longer waiting for its publish. Returns how many it added.
ADD_FOUND = (
    TAKE_OUT
    + """
local added, bytes = 0, 0
for i = 1, #ARGV, 4 do
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
  if ARGV[i + 3] == '1' then redis.call('SADD', KEYS[6], ARGV[i]) end
end
if added > 0 then
  redis.call('HINCRBY', KEYS[1], 'bytes', bytes)
  redis.call('HINCRBY', KEYS[1], 'chunks', added)
end
return added
"""
)

# KEYS: usage, lru, sizes, reserved, feed, records. ARGV: members. Takes chunks out; returns
# how many it held.
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

# KEYS: usage, lru, sizes, reserved, feed, records. ARGV: cap, max victims, oldest last use
# kept (-1: any). Takes out the least recently used chunks while usage is over the cap or
# their last use is older. Returns the victims, then their records string.
EVICT = (
    TAKE_OUT
    + """
local cap = tonumber(ARGV[1])
local before = tonumber(ARGV[3])
local victims, records = {}, {}
local used = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
while #victims < tonumber(ARGV[2]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local pick = oldest[1]
  if not pick then break end
  local over = cap >= 0 and used > cap
  local stale = before >= 0 and tonumber(oldest[2]) < before
  if not over and not stale then break end
  local freed, had = take_out(pick)
  used = used - freed
  victims[#victims + 1] = pick
  records[#records + 1] = had
end
victims[#victims + 1] = table.concat(records)
return victims
"""
)

# KEYS: usage, lru, sizes, reserved, feed, records. ARGV: the oldest reservation kept
# (seconds), members.
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

# KEYS: sizes, records. ARGV: members. Notes that these chunks' files have an access record
# beside them (a reader wrote one), for those the index holds. Returns how many it noted.
RECORD = """
local noted = 0
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    noted = noted + redis.call('SADD', KEYS[2], ARGV[i])
  end
end
return noted
"""

# KEYS: meta. ARGV: the stale mark a full reconcile saw when it began ('' if none). Clears
# the mark unless a writer set it anew meanwhile (its writes may lie in walked directories).
CLEAR_STALE = """
if (redis.call('HGET', KEYS[1], 'stale') or '') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'stale')
  return 1
end
return 0
"""
