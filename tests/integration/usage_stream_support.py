"""An edge's identity on the usage stream, for tests: the credential file its launch reads, the
registered edge whose stored hash keys its MAC, and entries signed (or forged) by hand."""

from __future__ import annotations

from pathlib import Path

from federation.inventory.models import Edge, Region
from federation.inventory.services import edge_register
from regions.tables.usage import (
    USAGE_EDGE_FIELD,
    USAGE_FIELD,
    USAGE_MAC_FIELD,
    usage_batch_mac,
    usage_stream_key,
)

#: The name metered test edges run under unless a test names its own.
STREAM_EDGE = "edge-metered"
CREDENTIAL = "fedinfer-edge-test-" + "c" * 32


def stream_args(where: Path, name: str = STREAM_EDGE, credential: str = CREDENTIAL) -> list[str]:
    """Launch flags that let a file-mode edge sign its stream entries as ``name``."""
    path = where / f"{name}.credential"
    path.write_text(credential)
    path.chmod(0o600)
    return ["--edge-name", name, "--credential-file", str(path)]


def stream_edge(region: Region, name: str = STREAM_EDGE, credential: str = CREDENTIAL) -> Edge:
    """``name`` registered in ``region`` (if it is not yet) with ``credential`` as its own."""
    edge = Edge.objects.filter(name=name).first() or edge_register(
        actor=None, region=region, name=name, url="http://e.invalid:1"
    )
    Edge.objects.filter(pk=edge.pk).update(
        credential_hash=usage_stream_key(credential).decode("ascii")
    )
    edge.refresh_from_db()
    return edge


def signed(
    batch: bytes, name: str = STREAM_EDGE, credential: str = CREDENTIAL
) -> dict[bytes, bytes]:
    """A stream entry's fields as the edge ``name`` holding ``credential`` writes them."""
    mac = usage_batch_mac(usage_stream_key(credential), name, batch)
    return {USAGE_FIELD: batch, USAGE_EDGE_FIELD: name.encode(), USAGE_MAC_FIELD: mac}
