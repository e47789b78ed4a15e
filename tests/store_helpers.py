"""Helpers of the context store's tests: a small record layout, fingerprints, KV to save and read back, and an
HTTP server with byte ranges (and ways to misbehave) for published stores."""
import hashlib
import http.server
import urllib.parse
from pathlib import Path

import torch

from edgekv.runtime.checksum import Trailer
from edgekv.runtime.disk_store import RecordLayout, aligned_zeros
from edgekv.runtime.store import ContextStore

REPO = Path(__file__).resolve().parents[1]
G, H, D, L, C = 4, 2, 16, 3, 8  # a chunk is 2 groups
LAYOUT = RecordLayout(G, H, D, torch.float32)
CHUNK_BYTES = L * (C // G) * LAYOUT.stride_bytes + Trailer.nbytes(L, C // G, LAYOUT.align_bytes)  # records, checksums


def fingerprint(tag: str, **extra) -> dict:
    return {"id": hashlib.sha256(tag.encode()).hexdigest(), "name": tag, "model_type": "llama", "n_layers": L,
            "n_kv_heads": H, "head_dim": D, "dtype": "float32", **extra}


FP = fingerprint("model-a")


def make_kv(n: int, seed: int = 0, layers: int = L):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)) for _ in range(layers)]


def open_store(path, fp=FP, **kw) -> ContextStore:
    return ContextStore.open(path, fp, LAYOUT, L, chunk_tokens=C, **kw)


def read_back(store: ContextStore, prefix, layout=LAYOUT, n_layers=L):
    """Per layer (k, v) [H_kv, prefix.n_tokens, d] rebuilt from the store's records."""
    out = []
    for layer in range(n_layers):
        ks, vs = [], []
        for ref in prefix.chunks:
            buf = aligned_zeros((ref.n_tokens // layout.group_tokens, layout.stride_bytes), layout.align_bytes)
            store.read(ref, layer, buf)
            rec = layout.typed(buf)  # [n, 2, H, G, d]
            for i, acc in ((0, ks), (1, vs)):
                acc.append(rec[:, i].transpose(0, 1).reshape(layout.n_kv_heads, -1, layout.head_dim).clone())
        out.append((torch.cat(ks, 1), torch.cat(vs, 1)))
    return out


def assert_same_kv(got, kv, n):
    for (k, v), (k0, v0) in zip(got, kv):
        assert k.shape[1] == n
        assert torch.equal(k, k0[:, :n]) and torch.equal(v, v0[:, :n])


def blobs(root) -> list[Path]:
    return sorted((Path(root) / "chunks").glob("*.kv"))


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """A static server with byte ranges (SimpleHTTPRequestHandler has none) and ways to misbehave."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        self.server.connections += 1

    def _head(self, status, length, **headers):
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()

    def do_GET(self):
        srv = self.server
        path = srv.root / urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
        if not path.is_file():
            self._head(404, 0)
            return
        data = path.read_bytes()
        rng = self.headers.get("Range")
        if rng is None or srv.mode == "ignore-range":
            self._head(200, len(data))
            self.wfile.write(data)
            return
        a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
        if srv.mode == "wrong-range":  # the right length from the wrong place
            a, b = a + 4096, b + 4096
        body = data[a:b + 1]
        self._head(206, len(body), Content_Range=f"bytes {a}-{a + len(body) - 1}/{len(data)}")
        if srv.mode in ("drop", "stall"):
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            if srv.mode == "stall":
                srv.release.wait(30)
            self.close_connection = True
            return
        self.wfile.write(body)
