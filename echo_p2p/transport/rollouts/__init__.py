"""Rollouts from inference peers to trainers, in both sync modes.

- ``push`` (inference side) / ``ingest`` (trainer side): async mode, version-tagged groups pushed to the
  trainers' replay buffers, acknowledged one by one.
- ``pull`` (trainer side) / ``sample`` (inference side): sync mode, a trainer asks for groups of given
  prompts at the version it just published.
- ``config``: the settings and wire bounds of all four.
- ``refusals``: why a trainer refuses a group (``Reason``): the codes senders receive, retryable or routine.

Nothing is imported here: importing the package stays free of hivemind and torch.
"""
