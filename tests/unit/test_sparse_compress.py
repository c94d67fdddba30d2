"""SparseLoCo's compressor (``dtrain/compress/sparse.py``): each chunk keeps its top-k by magnitude, the message
decodes to exactly what the sender kept back from its error feedback, its size is the documented one, and the
values land within half a magnitude step of the originals."""
from __future__ import annotations

import math

import pytest
import torch

from dtrain.compress.sparse import ChunkLayout, decode, encode, select
from dtrain.exchange import Sparse

from tests.helpers.sparseloco_reference import sparse_step
from tests.helpers.thread_world import FakeWorld


@pytest.mark.parametrize("numel, chunk, top_k", [(10000, 4096, 64), (300, 64, 5), (50, 4096, 64), (128, 64, 64)])
@pytest.mark.parametrize("bits", [1, 2, 3, 8, 32])
def test_each_chunk_keeps_its_largest_and_the_message_decodes_to_what_was_sent(numel, chunk, top_k, bits):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel + bits))
    layout = ChunkLayout(numel, chunk, top_k)
    positions = select(values, layout)
    assert positions.numel() == layout.kept == len(set(positions.tolist()))
    for start in range(0, numel, chunk):  # nothing left out of a chunk is larger than what it kept
        mine = positions[(positions >= start) & (positions < start + chunk)]
        rest = torch.ones(min(chunk, numel - start), dtype=torch.bool)
        rest[mine - start] = False
        if rest.any():
            assert values[start:start + chunk][rest].abs().max() <= values[mine].abs().min()
    message, sent = encode(values, positions, layout, bits)
    assert message.dtype == torch.uint8 and message.numel() == layout.payload_bytes(bits)
    chunks = math.ceil(numel / chunk)
    index_bits = max(1, math.ceil(math.log2(chunk)))
    assert layout.payload_bytes(bits) == math.ceil(layout.kept * index_bits / 8) + math.ceil(layout.kept * bits / 8) \
        + 8 * chunks
    where, received = decode(message, layout, bits)
    assert torch.equal(where, positions) and torch.equal(received, sent)
    kept = values[positions]
    if bits == 32:
        assert torch.equal(sent, kept)
    else:
        assert torch.equal(torch.sign(sent), torch.sign(kept))  # the sign bit
        span = kept.abs().max() - kept.abs().min()
        assert (sent - kept).abs().max() <= span / 2 ** (bits - 1) / 2 + 1e-6  # half a magnitude step


def test_a_message_of_another_size_is_refused():
    layout = ChunkLayout(300, 64, 5)
    with pytest.raises(ValueError, match="a sparse message of 3 bytes, expected 64"):
        decode(torch.zeros(3, dtype=torch.uint8), layout, 2)


def test_the_exchange_conserves_what_is_not_sent_and_matches_the_reference_on_threads():
    settings = dict(chunk_size=64, top_k=4, num_bits=2, decay=0.95)

    def work(comm):
        strategy = Sparse(**settings)
        strategy.bind(comm)
        error = torch.zeros(200)
        sums = []
        for step in range(3):
            x = torch.randn(200, generator=torch.Generator().manual_seed(10 * step + comm.rank))
            before = error * 0.95 + x
            flat = strategy.allreduce_("model", x.clone(), [torch.Size([200])])
            error = strategy.errors["model"].clone()
            sent = before - error  # conservation: decay * e + x = e' + what was sent
            assert int((sent.abs() > 0).sum()) <= 4 * 3 + 2  # no more values than the chunks keep
            sums.append(flat.clone())
        strategy.close()
        return sums

    results = FakeWorld(2).run(work)
    references = [torch.zeros(200), torch.zeros(200)]
    for step in range(3):
        sent = []
        for rank in range(2):
            x = torch.randn(200, generator=torch.Generator().manual_seed(10 * step + rank))
            references[rank], mine = sparse_step(references[rank], x, **settings)
            sent.append(mine)
        assert torch.equal(results[0][step], results[1][step])
        assert torch.allclose(results[0][step], sent[0] + sent[1], atol=1e-5), step


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="top_k=0"):
        Sparse(top_k=0)
    with pytest.raises(ValueError, match="top_k=65: expected at most learner.exchange.chunk_size=64"):
        Sparse(chunk_size=64, top_k=65)
    with pytest.raises(ValueError, match="decay"):
        Sparse(decay=1.5)
