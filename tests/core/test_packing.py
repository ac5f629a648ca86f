"""Packed (padding-free) layout: rows, positions and the way back, against hand-built expectations."""

import pytest
import torch

from lit_rlhf.core.packing import first_fit_rows, pack, unpack


def test_first_fit_decreasing_by_hand():
    # longest first: 5 → row 0 (room 1); 3 → row 1 (room 3); 3 → row 1 (room 0); 2 → row 2; 1 → row 0
    assert first_fit_rows([5, 3, 3, 2, 1], 6) == [[0, 4], [1, 2], [3]]
    assert first_fit_rows([7, 2], 6) == [[0], [1]]  # over-long: a row of its own


def sequences_of(ids, mask):
    return [ids[b][mask[b].bool()].tolist() for b in range(ids.shape[0])]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("one_row", [False, True])
def test_every_sequence_sits_whole_in_one_row_with_restarting_positions(side, one_row):
    lengths = [3, 1, 5, 2, 4, 0, 5]
    t = 5
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    next_id = 1
    for b, n in enumerate(lengths):
        cols = range(n) if side == "right" else range(t - n, t)
        for c in cols:
            ids[b, c], mask[b, c] = next_id, 1
            next_id += 1
    p = pack(ids, mask, pad_id=-1, one_row=one_row)
    assert p.input_ids.shape[0] == (1 if one_row else 4)  # 5 | 5 | 4+1 | 3+2
    assert p.input_ids.shape[1] == (20 if one_row else 5)
    # each sequence: contiguous in one row, positions 0..n-1 there; tokens appear exactly once
    rows = [r.tolist() for r in p.input_ids]
    positions = [r.tolist() for r in p.position_ids]
    for seq in sequences_of(ids, mask):
        if not seq:
            continue
        hits = [(r, row.index(seq[0])) for r, row in enumerate(rows) if seq[0] in row]
        assert len(hits) == 1
        r, c = hits[0]
        assert rows[r][c : c + len(seq)] == seq
        assert positions[r][c : c + len(seq)] == list(range(len(seq)))
    assert sorted(x for row in rows for x in row if x > 0) == list(range(1, next_id))
    # the padded tail of a row counts from 0 (a sequence of its own)
    for row, pos in zip(rows, positions):
        tail = [i for i, x in enumerate(row) if x == -1]
        assert [pos[i] for i in tail] == list(range(len(tail)))
    # back to the padded layout
    assert torch.equal(unpack(p.input_ids, p, fill=0), ids)
    feats = torch.arange(p.input_ids.numel() * 2, dtype=torch.float).view(*p.input_ids.shape, 2)
    back = unpack(feats, p, fill=-7.0)
    assert back.shape == (len(lengths), t, 2) and bool((back[mask == 0] == -7.0).all())


def test_packed_index_maps_real_tokens_and_refuses_padding():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    p = pack(ids, (ids > 0).long())
    flat_packed = p.input_ids.reshape(-1)
    assert flat_packed[p.packed_index(torch.tensor([0, 1, 2, 4, 5]))].tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="padding position"):
        p.packed_index(torch.tensor([3]))
