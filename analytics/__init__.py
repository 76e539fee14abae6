"""Phase decomposition, indicators, knee detection, SLOs (see the issues on analytics).

SQL in ClickHouse first, numpy on the aggregates; the same code runs on the
embedded store and on a server. One analysis run (``pipeline.analyze``, the
``tokenprobe analyze`` command in ``cli``) does, in order:

- ``calibration``: prefill time against prompt size per server and model,
  fitted robustly on requests that arrived to an idle server;
- ``phases``: every request's network in, queue, prefill, decode, network
  out, TTFT, TPOT, inter-token gaps and stalls (``contract.measures`` holds the SQL
  definition of each): the split of its TTFT into ``request_split``, beside the
  figures stored at insert (``request_figures``);
- ``knee``: where TTFT turns from flat to steep against concurrency;
- ``indicators``: the indicator matrix per server (and GPU) per window;
- ``slo``: compliance, multi-window burn rates and goodput.

Results go to the tables of ``contract.analysis``, which the dashboard reads;
``figures.window_figures`` gives the actuator's controller its inputs.
"""
