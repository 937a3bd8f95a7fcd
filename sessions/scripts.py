"""The Redis store's Lua scripts: each touches one key only (one hash slot, so Redis Cluster
runs it), and each is one round trip (EVALSHA, reloaded on NOSCRIPT by redis-py)."""

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
COMMIT = """
local stored = redis.call('HGET', KEYS[1], 'turn')
local turn = 0
if stored then turn = tonumber(stored) or 0 end
if turn ~= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(cjson.decode(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

RELEASE = """
if redis.call('HGET', KEYS[1], 'inflight') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'inflight', '')
  return 1
end
return 0
"""
