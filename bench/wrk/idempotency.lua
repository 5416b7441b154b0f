-- wrk script for `http_load --serve VARIANT`: every request is a POST to
-- /orders with an Idempotency-Key; a share of them (DUP, default 0.1)
-- re-sends a key this thread sent between OLD (default 1,024) and KEEP
-- (default 4,096) requests ago, never one of its first 256 (a retry of a
-- request that has completed: a replay, never a 409), the rest are fresh. Each wrk thread has its own key space, so threads never
-- collide by accident.
--
--   wrk -t2 -c64 -d10s -s bench/wrk/idempotency.lua http://127.0.0.1:8080/orders
--   DUP=0.9 wrk -t2 -c64 -d10s -s bench/wrk/idempotency.lua http://127.0.0.1:8080/orders

local dup = tonumber(os.getenv("DUP") or "0.1")
local KEEP = tonumber(os.getenv("KEEP") or "4096")
local OLD = tonumber(os.getenv("OLD") or "1024")
local threads = {}
local counter = 0

function setup(thread)
  counter = counter + 1
  thread:set("id", counter)
  table.insert(threads, thread)
end

function init(args)
  math.randomseed(id * 7919 + os.time())
  n = 0
  recent = {}
  wrk.method = "POST"
  wrk.body = '{"sku":"A","qty":1}'
  wrk.headers["Content-Type"] = "application/json"
end

-- The first FIRST keys of a thread are never re-sent: wrk may generate a
-- request for a connection that is not up yet and generate another once it
-- is, so an early key may never have been sent. A "re-send" of it is its
-- first request, and the concurrent re-sends of it (right after OLD keys,
-- every re-send picks the same one) all but one got a 409 (seen as a few
-- 409s per run, all for the key "t1-1").
local FIRST = 256

function request()
  local key
  -- A re-sent key is one this thread sent at least OLD requests ago (its
  -- first request has long completed, so it is a replay, not a 409), and
  -- at most KEEP ago.
  if n > OLD + FIRST and math.random() < dup then
    local lo = math.max(n - KEEP + 1, FIRST + 1)
    key = recent[(lo + math.random(0, n - OLD - lo)) % KEEP + 1]
  else
    n = n + 1
    key = "t" .. id .. "-" .. n
    recent[n % KEEP + 1] = key
  end
  wrk.headers["Idempotency-Key"] = key
  return wrk.format()
end

-- STATUS=1 counts the answers that are not 201 by status and prints them
-- at the end (off by default: a Lua call per response costs wrk time).
if os.getenv("STATUS") then
  function response(status, headers, body)
    if status ~= 201 then
      local k = "s" .. status
      _G[k] = (_G[k] or 0) + 1
    end
  end

  function done(summary, latency, requests)
    local seen = {}
    for _, t in ipairs(threads) do
      for _, s in ipairs({ 400, 409, 422, 500, 503 }) do
        local v = t:get("s" .. s)
        if v then seen[s] = (seen[s] or 0) + v end
      end
    end
    for s, v in pairs(seen) do
      io.write(string.format("status %d: %d\n", s, v))
    end
  end
end
