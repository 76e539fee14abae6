CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.request_latency_bands_mv TO {db}.request_latency_bands AS
SELECT
    toStartOfMinute(toDateTime(req_start, 'UTC')) AS minute,
    node, server_port, model, path,
    metric_band.1 AS metric,
    toInt16(assumeNotNull(metric_band.2)) AS band,
    count() AS requests
FROM {db}.requests
ARRAY JOIN arrayFilter(pair -> pair.2 IS NOT NULL, [('ttft', if(req_end IS NOT NULL AND first_token IS NOT NULL, toInt32(floor(log10(greatest(((toUnixTimestamp64Nano(assumeNotNull(first_token)) - toUnixTimestamp64Nano(assumeNotNull(req_end))) / 1e6), 0.01)) * 10)), NULL)), ('tpot', if(coalesce(completion_tokens, token_events) > 1 AND first_token IS NOT NULL AND last_token IS NOT NULL, toInt32(floor(log10(greatest(((toUnixTimestamp64Nano(assumeNotNull(last_token)) - toUnixTimestamp64Nano(assumeNotNull(first_token))) / 1e6) / (coalesce(completion_tokens, token_events) - 1), 0.01)) * 10)), NULL)), ('e2e', if(req_start IS NOT NULL AND resp_end IS NOT NULL, toInt32(floor(log10(greatest((((toUnixTimestamp64Nano(assumeNotNull(resp_end)) - toUnixTimestamp64Nano(assumeNotNull(req_start))) / 1e6) + if((req_seq = 0 AND accept_ts IS NOT NULL), ((toUnixTimestamp64Nano(req_start) - toUnixTimestamp64Nano(accept_ts)) / 1e6), 0)), 0.01)) * 10)), NULL)), ('all', 0)]) AS metric_band
WHERE role = 'server'
GROUP BY minute, node, server_port, model, path, metric, band
