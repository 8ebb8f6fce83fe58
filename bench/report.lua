-- wrk script of `make bench`: an optional POST body from the environment, and the result as one JSON line.
local method = os.getenv("BENCH_METHOD")
if method then
  wrk.method = method
  wrk.body = os.getenv("BENCH_BODY")
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Authorization"] = "Bearer " .. os.getenv("BENCH_KEY")
end

-- BENCH_PATHS: several paths, comma-separated, asked in turn by each connection (the polling agents' reads).
local paths = {}
for path in string.gmatch(os.getenv("BENCH_PATHS") or "", "[^,]+") do
  table.insert(paths, path)
end
-- BENCH_CONDITIONAL: each read sends If-None-Match with the newest ETag seen of each answer (a list, as RFC 9110
-- allows: wrk does not say which connection an answer came on, so not which path; an ETag names its own).
local conditional = os.getenv("BENCH_CONDITIONAL")
if #paths > 0 then
  local turn, newest = 0, {}
  request = function()
    turn = turn % #paths + 1
    if conditional and next(newest) then
      local tags = {}
      for _, tag in pairs(newest) do
        table.insert(tags, tag)
      end
      return wrk.format("GET", paths[turn], {["If-None-Match"] = table.concat(tags, ", ")})
    end
    return wrk.format("GET", paths[turn])
  end
  if conditional then
    response = function(status, headers, body)
      local tag = headers["ETag"] or headers["Etag"]
      if status == 200 and tag then
        local answer = string.match(tag, '^"%d+%-(%x+)"$')     -- "<generation>-<what was asked, by whom>"
        if answer then
          newest[answer] = tag
        end
      end
    end
  end
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\nBENCH {"requests": %d, "duration_us": %d, "connect_errors": %d, "read_errors": %d, "write_errors": %d, '
    .. '"status_errors": %d, "timeouts": %d, "p50_us": %d, "p99_us": %d, "mean_us": %.1f}\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
