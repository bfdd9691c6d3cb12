"""The in-tree KV connectors (``deepinfer_interfaces.KVConnector``), one module each, registered as
``deepinfer.kv_connectors`` entry points: a new connector is a module here (or in its own package) and
one entry-point line."""
