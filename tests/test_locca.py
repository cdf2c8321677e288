"""The LocCa decoder: per-example token-loss sums that do not depend on the rest of the batch, masks that hide padded
image tokens and (in causal mode) the future, boxes that survive quantisation."""

import pytest
import torch

from naflexclip.objectives.locca_decoder import DECODER_SIZES, LoccaDecoder
from naflexclip.processing.decoder_tokens import IGNORE, Vocabulary, collate_decoder, decoder_example

VOCAB = 100


def _decoder() -> LoccaDecoder:
    torch.manual_seed(0)
    return LoccaDecoder(DECODER_SIZES["tiny"], image_width=24, text_vocab=VOCAB).double().eval()


def _examples(vocab: Vocabulary) -> list[tuple[list[int], list[int], bool]]:
    length = DECODER_SIZES["tiny"].max_length
    rows = [("caption", [], [5, 6, 7, 8], False),
            ("aref", [9, 10], vocab.box_tokens([0.1, 0.2, 0.5, 0.9]), True),
            ("gcap", vocab.box_tokens([0, 0, 1, 1]), [11, 12], False)]
    return [(*decoder_example(vocab, task, prefix, target, parallel, length), parallel)
            for task, prefix, target, parallel in rows]


def test_an_examples_loss_is_the_same_alone_and_in_a_padded_batch():
    decoder = _decoder()
    examples = _examples(decoder.vocab)
    image = torch.randn(3, 7, 24, dtype=torch.double)
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[1, 4:] = False
    batch = decoder(image, valid, collate_decoder(examples, decoder.vocab))
    for row, example in enumerate(examples):
        alone = decoder(image[row : row + 1, : int(valid[row].sum())], valid[row : row + 1, : int(valid[row].sum())],
                        collate_decoder([example], decoder.vocab))
        torch.testing.assert_close(alone.token_loss_sum[0], batch.token_loss_sum[row], rtol=1e-12, atol=1e-12)
    assert batch.target_tokens.tolist() == [4, 4, 2]


def test_columns_padded_in_every_row_are_not_computed_and_change_no_loss():
    decoder = _decoder()
    examples = _examples(decoder.vocab)
    image = torch.randn(3, 7, 24, dtype=torch.double)
    valid = torch.ones(3, 7, dtype=torch.bool)
    longest = decoder(image, valid, collate_decoder(examples, decoder.vocab))
    wide = decoder(image, valid, collate_decoder(examples, decoder.vocab, length=decoder.config.max_length))
    assert longest.logits.shape[1] < decoder.config.max_length
    assert wide.logits.shape == longest.logits.shape  # the vocabulary projection skips the all-padding columns
    torch.testing.assert_close(wide.token_loss_sum, longest.token_loss_sum, rtol=1e-12, atol=1e-12)
    assert torch.equal(wide.target_tokens, longest.target_tokens)


def test_a_float64_decoder_computes_its_loss_in_float64():
    # failed before: the loss was computed on logits.float(), so verify's float64 decoder term carried float32
    # rounding (1e-9 relative gradient errors once microbatches trimmed their padding to different widths)
    decoder = _decoder()
    out = decoder(torch.randn(3, 7, 24, dtype=torch.double), torch.ones(3, 7, dtype=torch.bool),
                  collate_decoder(_examples(decoder.vocab), decoder.vocab))
    assert out.token_loss_sum.dtype == torch.float64


def test_greedy_decoding_takes_each_rows_argmax_of_the_full_forward():
    decoder = _decoder()
    vocab = decoder.vocab
    image = torch.randn(2, 7, 24, dtype=torch.double)
    valid = torch.ones(2, 7, dtype=torch.bool)
    prefixes = [[5, 6, 7], [9]]
    generated = decoder.generate(image, valid, "aref", prefixes, max_new_tokens=4)
    for r, prefix in enumerate(prefixes):  # one row at a time, every position projected, the next token its argmax
        ids = [vocab.task("aref"), *prefix, vocab.start]
        for token in generated[r]:
            batch = collate_decoder([(ids, [IGNORE] * len(ids), False)], vocab)
            assert int(decoder(image[r : r + 1], valid[r : r + 1], batch).logits[0, -1].argmax()) == token
            ids.append(token)
    assert [len(g) for g in generated] == [4, 4]


def test_padded_image_tokens_are_not_seen():
    decoder = _decoder()
    batch = collate_decoder(_examples(decoder.vocab), decoder.vocab)
    image = torch.randn(3, 7, 24, dtype=torch.double)
    valid = torch.ones(3, 7, dtype=torch.bool)
    valid[:, 5:] = False
    other = image.clone()
    other[:, 5:] = 1e3
    torch.testing.assert_close(decoder(image, valid, batch).token_loss_sum, decoder(other, valid, batch).token_loss_sum)


def test_causal_positions_do_not_see_the_future_and_parallel_ones_do():
    decoder = _decoder()
    vocab = decoder.vocab
    length = DECODER_SIZES["tiny"].max_length
    image = torch.randn(1, 5, 24, dtype=torch.double)
    valid = torch.ones(1, 5, dtype=torch.bool)
    for parallel in (False, True):
        ids, labels = decoder_example(vocab, "caption", [], [5, 6, 7, 8], parallel, length)
        changed_ids = list(ids)
        changed_ids[-1] = 42 if not parallel else vocab.start  # the last input token only
        first = decoder(image, valid, collate_decoder([(ids, labels, parallel)], vocab)).logits[0, 1]
        second = decoder(image, valid, collate_decoder([(changed_ids, labels, parallel)], vocab)).logits[0, 1]
        assert torch.equal(first, second) is (not parallel)


def test_labels_sit_on_the_target_positions_only():
    vocab = Vocabulary(text_vocab=VOCAB, box_bins=1000)
    ids, labels = decoder_example(vocab, "gcap", [1, 2, 3], [7, 8], False, 40)
    assert ids == [vocab.task("gcap"), 1, 2, 3, vocab.start, 7]
    assert labels == [IGNORE, IGNORE, IGNORE, IGNORE, 7, 8]
    ids, labels = decoder_example(vocab, "gcap", [1, 2, 3], [7, 8], True, 40)
    assert ids == [vocab.task("gcap"), 1, 2, 3, vocab.mask, vocab.mask]
    # a long target keeps its tokens before a long prefix does, within max_length
    ids, labels = decoder_example(vocab, "caption", list(range(30)), list(range(50)), False, 40)
    assert len(ids) == len(labels) == 40 and sum(label != IGNORE for label in labels) >= 20


@pytest.mark.parametrize("box", [(0.0, 0.0, 1.0, 1.0), (0.1, 0.25, 0.5, 0.75), (0.333, 0.5, 0.9, 0.999)])
def test_boxes_round_trip_through_coordinate_tokens_within_one_bin(box):
    vocab = Vocabulary(text_vocab=VOCAB, box_bins=1000)
    tokens = vocab.box_tokens(box)
    assert all(VOCAB <= t < vocab.output_size for t in tokens)
    assert max(abs(a - b) for a, b in zip(vocab.box_of(tokens), box, strict=True)) <= 0.5 / 999 + 1e-12
    assert vocab.box_of([1, 2, 3, 4]) is None
