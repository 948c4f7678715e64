"""The connector a ``KVTransferConfig`` names, checked against what the runner can move."""

from __future__ import annotations

from jaxrunner.config import RunnerConfig
from jaxrunner.runner.kv_connector.base import KVConnectorBase
from jaxrunner.runner.kv_connector.block_store_connector import BlockStoreConnector
from jaxrunner.runner.kv_connector.block_stores import DirectoryStore, HostPool


def make_kv_connector(config: RunnerConfig, multimodal: bool) -> KVConnectorBase:
    """The configured connector, or the no-op one; ValueError or NotImplementedError saying what cannot be."""
    transfer = config.kv_transfer_config
    if transfer is None or transfer.kv_connector == "NoOpConnector":
        return KVConnectorBase()
    unsupported = [
        ("speculative decoding", config.speculative_config is not None),
        ("a vision-language model", multimodal),
    ]
    for feature, used in unsupported:
        if used:
            raise NotImplementedError(f"A KV connector cannot be used with {feature} yet; turn one of them off.")
    extra = transfer.kv_connector_extra_config
    block_size = config.cache_config.block_size
    if transfer.kv_connector == "OffloadingConnector":
        num_blocks = extra.get("num_cpu_blocks")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool):
            raise ValueError(
                "The OffloadingConnector needs kv_connector_extra_config={'num_cpu_blocks': n}: the blocks its "
                f"host pool holds; got {num_blocks!r}."
            )
        return BlockStoreConnector(HostPool(num_blocks), block_size, transfer.kv_role)
    path = extra.get("shared_storage_path")
    if not isinstance(path, str) or not path:
        raise ValueError(
            "The SharedStorageConnector needs kv_connector_extra_config={'shared_storage_path': directory}; "
            f"got {path!r}."
        )
    try:
        store = DirectoryStore(path)
    except OSError as error:
        raise ValueError(f"The SharedStorageConnector cannot use {path!r}: {error}") from error
    return BlockStoreConnector(store, block_size, transfer.kv_role, tails=True)
