"""KV connectors (vLLM's ``KVConnectorBase_V1``): KV blocks moved between the device cache and a store
outside it, around the forward step. ``make_kv_connector`` builds the one a ``KVTransferConfig`` names."""
