"""The receiver side of the weights transport: find, fetch, verify and apply policy versions, and serve them on.

Modules, each one concept (the imports go down this list, never up):

- ``fetcher``: ``WeightFetcher``, the public API (trusted records, manifests, the chain, the atomic apply,
  serving and announcing what it holds).
- ``manifests``: ``ManifestCheck`` (which manifests to accept: trusted signature, this run, the policy
  record's reference; refusals remembered) and ``get_manifests`` (asking the publisher, then providers).
- ``session``: ``FetchSession``, one transfer of a chain from several providers: provider discovery,
  chunk-map polls, and what each stream's outcome means (retry, back-off, drop, ban through a callback).
- ``reader``: ``read_stream``, one chunk stream from request to verified chunks, returning a
  ``StreamOutcome``; it decides nothing about the provider.
- ``scheduler``: ``ChunkScheduler``, which chunk to ask of which provider (no I/O, no clock of its own).
- ``providers``: ``Source`` (one provider during one fetch) and ``ProviderBook`` (bans across fetches).
- ``chain``: ``plan_chain``, which manifests lead to a version.
- ``announce``: ``CoalescedStore``, the provider record's coalesced stores.
- ``config``: ``FetcherConfig``, ``FetchStats``, ``FetchError``, ``FetchProgress``.

Nothing is imported here: import each name from its module.
"""
