-- wrk script: POST the JSON body of $BENCH_BODY_FILE to the URL given on the command line and
-- print one machine-readable line (prefix "BENCHJSON ") with counts and latency percentiles in
-- microseconds. Used by bench/overhead.py.
local f = assert(io.open(os.getenv("BENCH_BODY_FILE"), "rb"))
local body = f:read("*a")
f:close()

wrk.method = "POST"
wrk.body = body
wrk.headers["Content-Type"] = "application/json"

-- Optional pacing ($BENCH_DELAY_MS): each connection waits a random 0.5-1.5 x that delay
-- before its next request, so N connections offer about N / (delay + latency) requests/s:
-- "N concurrent" below saturation instead of a closed loop flat out.
local pace = tonumber(os.getenv("BENCH_DELAY_MS") or "")
if pace and pace > 0 then
  math.randomseed(os.time())
  delay = function()
    return pace * (0.5 + math.random())
  end
end

local function p(latency, q)
  return latency:percentile(q)
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCHJSON {"requests":%d,"duration_us":%d,"bytes":%d,'
      .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
      .. '"latency_us":{"min":%d,"mean":%.1f,"p50":%d,"p90":%d,"p99":%d,"p999":%d,"max":%d,"stdev":%.1f}}\n',
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, p(latency, 50), p(latency, 90), p(latency, 99), p(latency, 99.9),
    latency.max, latency.stdev))
end
