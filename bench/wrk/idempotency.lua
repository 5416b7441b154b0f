-- wrk script for `http_load --serve VARIANT`: every request is a POST to
-- /orders with an Idempotency-Key; a share of them (DUP, default 0.1)
-- re-sends one of the last keys this thread sent (a retry: a replay once
-- the first is done), the rest are fresh. Each wrk thread has its own
-- key space, so threads never collide by accident.
--
--   wrk -t2 -c64 -d10s -s bench/wrk/idempotency.lua http://127.0.0.1:8080/orders
--   DUP=0.9 wrk -t2 -c64 -d10s -s bench/wrk/idempotency.lua http://127.0.0.1:8080/orders

local dup = tonumber(os.getenv("DUP") or "0.1")
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

function request()
  local key
  if #recent > 0 and math.random() < dup then
    key = recent[math.random(#recent)]
  else
    n = n + 1
    key = "t" .. id .. "-" .. n
    recent[(n % 64) + 1] = key
  end
  wrk.headers["Idempotency-Key"] = key
  return wrk.format()
end

function done(summary, latency, requests)
  local statuses = summary.errors.status
  io.write(string.format("non-2xx/3xx responses: %d\n", statuses))
end
