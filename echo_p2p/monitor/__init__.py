"""A live view of one run, read from the DHT only: ``python -m echo_p2p.monitor``, ``local --monitor``,
``bootstrap --monitor-port``.

What a person who runs or joins a swarm asks first — is it alive, who is in it, is it learning — answered by
one page (run header, reward and rollouts-consumed curves, a table of peers, alerts) and the same data as
JSON at ``/api/status`` (exactly what ``swarm status --json`` prints) and ``/api/history``.

Modules, each small:

- ``config``: ``MonitorConfig`` — where to listen, how often to read, the alert thresholds.
- ``status``: reading one snapshot of the run's directory and turning it into the status dict (bounded,
  validated, finite numbers only); shared with ``swarm status``.
- ``alerts``: the alert rules, pure functions of a status dict and the ``Timers`` kept between reads.
- ``history``: ``Tracker``, the time series and timers a running monitor keeps (bounded).
- ``poller``: a thread that reads the directory on a period and keeps the newest status.
- ``server``: the aiohttp application (page, API, CSP and Host-header checks) and a server in a thread.
- ``target``: the command-line flags that name a run (``--run-id``/``--join``/``--trusted-trainers``).
- ``__main__``: the CLI.
- ``static/``: the page, its script (draws the charts as inline SVG; nothing is fetched from elsewhere)
  and its style.

It never writes to the DHT: it runs a client-mode node (or borrows the node of the process it lives in)
and only reads. Every figure on the page comes from peers and is untrusted: the status is built from
validated records with strings cut to bounds and non-finite numbers dropped, and the page puts peer data
into the document as text only, never as markup.
"""
