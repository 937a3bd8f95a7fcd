"""The Redis store's Lua scripts: each is one round trip (EVALSHA, reloaded on NOSCRIPT by
redis-py). Each touches one key, one conversation's state and its spent handles (one slot),
or one conversation's state and one D's pin index (COMMIT_NOTED: not for Redis Cluster, where
they are in other slots)."""

from __future__ import annotations

# A handle read or released is "spent" (issue 48: read at most once): its digest goes into
# the conversation's spent ZSET (in the conversation's slot) until its handle_expires_at (or
# now + 900 s without a sound one), past which D no longer pins it and the router would not
# send it.
# Entries past their time are trimmed, and the key expires with its last entry.
_SPEND = """
local function spend(spent, id, deadline, now)
  redis.call('ZADD', spent, deadline, id)
  redis.call('ZREMRANGEBYSCORE', spent, '-inf', now)
  local last = redis.call('ZRANGE', spent, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', spent, math.ceil(tonumber(last[2]) * 1000) + 1000)
  end
end
local function field(fields, name)
  for i = 1, #fields, 2 do
    if fields[i] == name then return i + 1 end
  end
  return nil
end
local function has_handle(params)
  return params and params ~= '' and params ~= 'null'
end
local function handle_until(fields, now)
  local at = field(fields, 'handle_expires_at')
  local deadline = at and tonumber(fields[at]) or 0
  -- not a number (NaN fails every comparison), past, or absurdly far: now + 900 s
  if not (deadline > now and deadline < now + 86400) then deadline = now + 900 end
  return deadline
end
-- A spent handle still in the hash (a record older than the conversation) is cleared, with
-- its reason, in the hash and in the copy returned. True when it was one.
local function refuse_spent(key, spent, fields, at)
  if not redis.call('ZSCORE', spent, redis.sha1hex(fields[at])) then return false end
  redis.call('HSET', key, 'kv_transfer_params', '', 'no_handle_reason', 'stale-handle')
  fields[at] = ''
  local reason = field(fields, 'no_handle_reason')
  if reason then
    fields[reason] = 'stale-handle'
  else
    table.insert(fields, 'no_handle_reason')
    table.insert(fields, 'stale-handle')
  end
  return true
end
"""

# Returns the hash as it was; takes the handle (single use) if there is one, and, when
# ARGV[2] is not empty, only if the prefix digest is ARGV[2]. ARGV[3]: now (wall clock). A
# handle taken is spent (KEYS[2]); one spent before is refused (`no_handle_reason`
# stale-handle, in the hash and in the reply) instead of taken.
CLAIM = (
    _SPEND
    + """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return false end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'prefix_digest') ~= ARGV[2] then
  return fields
end
local at = field(fields, 'kv_transfer_params')
if not at or not has_handle(fields[at]) then return fields end
if refuse_spent(KEYS[1], KEYS[2], fields, at) then return fields end
local now = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'kv_transfer_params', '', 'inflight', ARGV[1])
spend(KEYS[2], redis.sha1hex(fields[at]), handle_until(fields, now), now)
return fields
"""
)

# ARGV: expected turn, TTL in ms, then the fields as one JSON array [field, value, ...] (one
# argument for redis-py to encode instead of 44). A missing (or unreadable) turn is 0, so a
# first commit, or one over a garbage hash, goes through with expected turn 0.
_COMMIT = """
local function commit(key, expected, ttl, fields)
  local stored = redis.call('HGET', key, 'turn')
  local turn = 0
  if stored then turn = tonumber(stored) or 0 end
  if turn ~= tonumber(expected) then return false end
  redis.call('DEL', key)
  redis.call('HSET', key, unpack(cjson.decode(fields)))
  redis.call('PEXPIRE', key, ttl)
  return true
end
"""
COMMIT = (
    _COMMIT
    + """
if commit(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) then return 1 end
return 0
"""
)

RELEASE = """
if redis.call('HGET', KEYS[1], 'inflight') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'inflight', '')
  return 1
end
return 0
"""

# Takes the handle for release (single use, as CLAIM): only when there is one, no turn holds
# the state (`inflight` empty) and `updated_at` <= ARGV[1] ('' : no bound). Returns the hash
# as it was, or false and changes nothing. The handle is cleared as CLAIM clears it, and
# `no_handle_reason` becomes ARGV[2] (`released`) so that the next turn says why; it is spent
# (KEYS[2]; ARGV[3]: now). One spent before is refused as CLAIM refuses it (false: there is
# nothing to release).
TAKE_HANDLE = (
    _SPEND
    + """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return false end
local f = {}
for i = 1, #fields, 2 do f[fields[i]] = fields[i + 1] end
local params = f['kv_transfer_params']
if not has_handle(params) then return false end
if f['inflight'] and f['inflight'] ~= '' then return false end
if ARGV[1] ~= '' then
  local updated = tonumber(f['updated_at'] or '')
  if not updated or updated > tonumber(ARGV[1]) then return false end
end
if refuse_spent(KEYS[1], KEYS[2], fields, field(fields, 'kv_transfer_params')) then
  return false
end
local now = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'kv_transfer_params', '', 'no_handle_reason', ARGV[2])
spend(KEYS[2], redis.sha1hex(params), handle_until(fields, now), now)
return fields
"""
)

# The conversation ended: its hash as it was, deleted (false when there is none). Its handle,
# which the router then releases, is spent (KEYS[2]; ARGV[1]: now) and the spent key stays, so
# a record restored after the end is refused too. A handle spent before comes back without it.
END = (
    _SPEND
    + """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return false end
redis.call('DEL', KEYS[1])
local at = field(fields, 'kv_transfer_params')
if at and has_handle(fields[at]) then
  local now = tonumber(ARGV[1])
  local id = redis.sha1hex(fields[at])
  if redis.call('ZSCORE', KEYS[2], id) then
    fields[at] = ''
  else
    spend(KEYS[2], id, handle_until(fields, now), now)
  end
end
return fields
"""
)

# A handle the router released without knowing whether a commit stored it (the commit timed
# out): spent (KEYS[2]; ARGV: its digest, until, now), and out of the hash (KEYS[1]) if it is
# there, which then says `released`.
SPEND = (
    _SPEND
    + """
local now = tonumber(ARGV[3])
spend(KEYS[2], ARGV[1], tonumber(ARGV[2]), now)
local params = redis.call('HGET', KEYS[1], 'kv_transfer_params')
if has_handle(params) and redis.sha1hex(params) == ARGV[1] then
  redis.call('HSET', KEYS[1], 'kv_transfer_params', '', 'no_handle_reason', 'released')
end
return 1
"""
)

# The blocks of D a member's handle pins: `held` (a HASH member -> block names joined by
# spaces) and `blocks` (a HASH block name -> how many of the index's handles pin it, the field
# gone at 0: its HLEN is D's distinct pinned blocks). `names` replaces the member's blocks
# ('' forgets them). Only the difference is parsed and written: a conversation's next handle on
# the same D begins with the blocks its former one began with (D's prefix cache served them),
# so the leading names both lists share are skipped as bytes (`kept`: compared 256 bytes at a
# time, then by halving), the rest is counted in a table, and each changed block costs one
# field of an HMGET, HSET or HDEL of at most 512. A repeated note (a retried script) changes
# nothing. A member without `held` (noted by a router before these keys) has no blocks to take
# back, and a count whose key expired never goes below 0.
_HOLD = """
local function kept(a, b)
  local n, i = math.min(#a, #b), 0
  while i < n and string.sub(a, i + 1, i + 256) == string.sub(b, i + 1, i + 256) do
    i = i + 256
  end
  i = math.min(i, n)
  local hi = math.min(i + 256, n)
  while i < hi do
    local mid = math.ceil((i + hi) / 2)
    if string.sub(a, i + 1, mid) == string.sub(b, i + 1, mid) then i = mid else hi = mid - 1 end
  end
  while i > 0 do
    local x, y = string.byte(a, i + 1), string.byte(b, i + 1)
    if (x == nil or x == 32) and (y == nil or y == 32) then break end
    i = i - 1
  end
  return i
end

local function hold(held, blocks, member, names)
  local before = redis.call('HGET', held, member) or ''
  local skip = kept(before, names) + 1
  local delta, changed = {}, {}
  for name in string.gmatch(string.sub(before, skip), '%S+') do
    delta[name] = (delta[name] or 0) - 1
  end
  for name in string.gmatch(string.sub(names, skip), '%S+') do
    delta[name] = (delta[name] or 0) + 1
  end
  for name, d in pairs(delta) do
    if d ~= 0 then changed[#changed + 1] = name end
  end
  for first = 1, #changed, 512 do
    local part = {unpack(changed, first, math.min(first + 511, #changed))}
    local counts = redis.call('HMGET', blocks, unpack(part))
    local set, gone = {}, {}
    for i, name in ipairs(part) do
      local n = (tonumber(counts[i]) or 0) + delta[name]
      if n > 0 then
        set[#set + 1] = name
        set[#set + 1] = n
      else
        gone[#gone + 1] = name
      end
    end
    if #set > 0 then redis.call('HSET', blocks, unpack(set)) end
    if #gone > 0 then redis.call('HDEL', blocks, unpack(gone)) end
  end
  if names == '' then
    redis.call('HDEL', held, member)
  elseif names ~= before then
    redis.call('HSET', held, member, names)
  end
end
"""

# One pin index (a ZSET, KEYS[1]), its sizes, held and blocks (HASHes, KEYS[2..4]): ARGV score,
# member, TTL in ms, "<blocks> <tokens>", the block names. Each key's expiry only grows (a key
# without one gets it), so an index nobody notes into any more disappears. Without an index,
# what is beside it belongs to no member (an older router emptied it): it starts afresh.
_NOTE_PIN = (
    _HOLD
    + """
local function note_pin(keys, score, member, ttl, size, names)
  if redis.call('EXISTS', keys[1]) == 0 then redis.call('DEL', keys[2], keys[3], keys[4]) end
  redis.call('ZADD', keys[1], score, member)
  redis.call('HSET', keys[2], member, size)
  hold(keys[3], keys[4], member, names)
  for _, key in ipairs(keys) do
    if redis.call('PTTL', key) < tonumber(ttl) then redis.call('PEXPIRE', key, ttl) end
  end
end
"""
)
NOTE_PIN = (
    _NOTE_PIN
    + """
note_pin(KEYS, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
return 1
"""
)

# COMMIT, and when it commits, NOTE_PIN of the conversation (KEYS[1]) in D's pin index
# (KEYS[2..5]) in the same round trip: ARGV as COMMIT's, then the note's score, size and block
# names (its TTL is the state's).
COMMIT_NOTED = (
    _COMMIT
    + _NOTE_PIN
    + """
if not commit(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) then return 0 end
note_pin({KEYS[2], KEYS[3], KEYS[4], KEYS[5]}, ARGV[4], KEYS[1], ARGV[2], ARGV[5], ARGV[6])
return 1
"""
)

# A conversation out of D's pin index, its sizes and its blocks; with ARGV[2] (not ''), only
# while its entry is not newer than that (a handle it committed since stays indexed). An
# index that empties takes
# the keys beside it along, so whatever they held for no member (written by an older router,
# which forgets without taking blocks back) is not counted for ever.
FORGET_PIN = (
    _HOLD
    + """
if ARGV[2] ~= '' then
  local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if score and tonumber(score) > tonumber(ARGV[2]) then return 0 end
end
hold(KEYS[3], KEYS[4], ARGV[1], '')
redis.call('HDEL', KEYS[2], ARGV[1])
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[2], KEYS[3], KEYS[4]) end
return removed
"""
)

# D's pin index summed: {handles, distinct blocks, the handles' blocks, tokens} (KEYS index,
# sizes, blocks; a size that does not parse counts 0).
PIN_TOTALS = """
local blocks, tokens = 0, 0
for _, size in ipairs(redis.call('HVALS', KEYS[2])) do
  local b, t = string.match(size, '^(%d+) (%d+)$')
  if b then blocks = blocks + tonumber(b); tokens = tokens + tonumber(t) end
end
return {redis.call('ZCARD', KEYS[1]), redis.call('HLEN', KEYS[3]), blocks, tokens}
"""

# The server's run id against the one recorded (KEYS[1], a HASH; ARGV: run id, now): the time
# since when this run id is the store's. None recorded: this one, since 0 (a first start, or a
# store that never had routers of this version: nothing to doubt). Another: since now.
STORE_RUN = """
local run = redis.call('HGET', KEYS[1], 'run_id')
if run == ARGV[1] then return redis.call('HGET', KEYS[1], 'since') or '0' end
local since = ARGV[2]
if not run then since = '0' end
redis.call('HSET', KEYS[1], 'run_id', ARGV[1], 'since', since)
return since
"""

# The ping's second half: the server runs the router's scripts (an ACL may allow PING only).
PROBE = "return 1"
