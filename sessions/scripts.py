"""The Redis store's Lua scripts: each is one round trip (EVALSHA, reloaded on NOSCRIPT by
redis-py). Each touches one key, or one conversation's state and one D's pin index
(COMMIT_NOTED: not for Redis Cluster, where they are in other slots)."""

from __future__ import annotations

# Returns the hash as it was; takes the handle (single use) if there is one, and, when
# ARGV[2] is not empty, only if the prefix digest is ARGV[2].
CLAIM = """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return false end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'prefix_digest') ~= ARGV[2] then
  return fields
end
for i = 1, #fields, 2 do
  if fields[i] == 'kv_transfer_params' then
    local params = fields[i + 1]
    if params ~= '' and params ~= 'null' then
      redis.call('HSET', KEYS[1], 'kv_transfer_params', '', 'inflight', ARGV[1])
    end
    break
  end
end
return fields
"""

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
# `no_handle_reason` becomes ARGV[2] (`released`) so that the next turn says why.
TAKE_HANDLE = """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return false end
local f = {}
for i = 1, #fields, 2 do f[fields[i]] = fields[i + 1] end
local params = f['kv_transfer_params']
if not params or params == '' or params == 'null' then return false end
if f['inflight'] and f['inflight'] ~= '' then return false end
if ARGV[1] ~= '' then
  local updated = tonumber(f['updated_at'] or '')
  if not updated or updated > tonumber(ARGV[1]) then return false end
end
redis.call('HSET', KEYS[1], 'kv_transfer_params', '', 'no_handle_reason', ARGV[2])
return fields
"""

# The conversation ended: its hash as it was, deleted (false when there is none).
END = """
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then return false end
redis.call('DEL', KEYS[1])
return fields
"""

# One pin index (a ZSET, KEYS[1]) and its sizes (a HASH, KEYS[2]): ARGV score, member, TTL in
# ms, "<blocks> <tokens>". Each key's expiry only grows (a key without one gets it), so an
# index nobody notes into any more disappears.
_NOTE_PIN = """
local function note_pin(index, sizes, score, member, ttl, size)
  redis.call('ZADD', index, score, member)
  redis.call('HSET', sizes, member, size)
  for _, key in ipairs({index, sizes}) do
    if redis.call('PTTL', key) < tonumber(ttl) then redis.call('PEXPIRE', key, ttl) end
  end
end
"""
NOTE_PIN = (
    _NOTE_PIN
    + """
note_pin(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
return 1
"""
)

# COMMIT, and when it commits, NOTE_PIN of the conversation (KEYS[1]) in D's pin index
# (KEYS[2], KEYS[3]) in the same round trip: ARGV as COMMIT's, then the note's score and size
# (its TTL is the state's).
COMMIT_NOTED = (
    _COMMIT
    + _NOTE_PIN
    + """
if not commit(KEYS[1], ARGV[1], ARGV[2], ARGV[3]) then return 0 end
note_pin(KEYS[2], KEYS[3], ARGV[4], KEYS[1], ARGV[2], ARGV[5])
return 1
"""
)

# A conversation out of D's pin index and its sizes.
FORGET_PIN = """
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

# D's pin index summed: {handles, blocks, tokens} (a size that does not parse counts 0).
PIN_TOTALS = """
local blocks, tokens = 0, 0
for _, size in ipairs(redis.call('HVALS', KEYS[2])) do
  local b, t = string.match(size, '^(%d+) (%d+)$')
  if b then blocks = blocks + tonumber(b); tokens = tokens + tonumber(t) end
end
return {redis.call('ZCARD', KEYS[1]), blocks, tokens}
"""
