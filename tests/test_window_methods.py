"""The two methods agree, scalars are counted once, RNG is replayed, any OpenCLIP-style model works,
and every window error names the offending value."""

import open_clip
import pytest
import torch
from window_cases import failures, full_batch_gradients, loss_for, naflex_window, tiny_model

from naflexclip import accumulate_gradients, create_loss, create_model
from naflexclip.audit.gradient_audit import collect_gradients, relative_error
from naflexclip.batch import concat_microbatches, split_batch, to_device


@pytest.mark.parametrize("siglip", [False, True], ids=["clip", "siglip"])
def test_cache_and_replay_agree(siglip):
    model, loss_fn, batch = tiny_model(siglip), loss_for(siglip), naflex_window(7, seed=3)
    grads = {}
    for method in ("cache", "replay"):
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, loss_fn, split_batch(batch, [3, 1, 3]), loss_scale="sqrt",
                             reference_batch_size=2, method=method)
        grads[method] = collect_gradients(model)
    for name, grad in grads["cache"].items():
        assert relative_error(grads["replay"][name], grad) < 1e-12, name


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_logit_scale_and_bias_are_counted_once(method):
    model, loss_fn, batch = tiny_model(True), loss_for(True), naflex_window(6, seed=4)
    reference = full_batch_gradients(model, loss_fn, batch, scale=1.0)
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, loss_fn, split_batch(batch, [1, 1, 2, 2]), method=method)
    for name in ("logit_scale", "logit_bias"):
        ratio = (model.get_parameter(name).grad / reference[name]).item()
        assert ratio == pytest.approx(1.0, abs=1e-10), f"{name} gradient is {ratio}× the full batch's (4 microbatches)"


def test_accumulation_adds_to_existing_gradients():
    model, loss_fn, batch = tiny_model(False), loss_for(False), naflex_window(4, seed=5)
    reference = full_batch_gradients(model, loss_fn, batch, scale=1.0)
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        accumulate_gradients(model, loss_fn, split_batch(batch, [2, 2]))
    doubled = {name: 2 * grad for name, grad in reference.items()}
    assert failures(model, doubled) == {}


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_stochastic_layers_draw_the_same_numbers_in_cached_and_grad_forward(method):
    torch.manual_seed(0)
    model = create_model("tiny", drop_path_rate=0.3, proj_drop_rate=0.3, patch_drop_rate=0.25).double().train()
    batch = naflex_window(6, seed=6)
    image_outputs = []
    model.image_projection.register_forward_hook(lambda mod, inp, out: image_outputs.append(out.detach().clone()))
    text_outputs = []
    model.text.register_forward_hook(lambda mod, inp, out: text_outputs.append(out.detach().clone()))
    accumulate_gradients(model, create_loss("clip"), split_batch(batch, [2, 1, 3]), method=method)
    # three no-grad forwards, then three grad forwards of the same microbatches: bit-for-bit equal
    assert len(image_outputs) == 6
    for outputs in (image_outputs, text_outputs):
        for cached, regrad in zip(outputs[:3], outputs[3:], strict=True):
            assert torch.equal(cached, regrad)
    # teeth: without the replayed RNG state the two forwards of a microbatch differ
    mb = split_batch(batch, [6])[0]
    with torch.no_grad():
        first, second = model.encode_image(mb["image"]), model.encode_image(mb["image"])
    assert not torch.equal(first, second)


def test_window_rng_stream_continues_as_after_the_cached_forwards():
    # replaying must not rewind the global generator: the next window draws fresh masks
    torch.manual_seed(0)
    model = create_model("tiny", drop_path_rate=0.3).double().train()
    batch = naflex_window(4, seed=7)
    before_window = torch.get_rng_state()
    accumulate_gradients(model, create_loss("clip"), split_batch(batch, [2, 2]))
    after_window = torch.rand(1)
    torch.set_rng_state(before_window)
    with torch.no_grad():
        for mb in split_batch(batch, [2, 2]):
            model(image=mb["image"], text=mb["text"])
    assert torch.equal(after_window, torch.rand(1))


def open_clip_model(output_dict: bool = True, init_logit_bias: float | None = None):
    torch.manual_seed(0)
    return open_clip.model.CLIP(
        embed_dim=16,
        vision_cfg=open_clip.model.CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=16),
        text_cfg=open_clip.model.CLIPTextCfg(context_length=8, vocab_size=100, width=32, heads=2, layers=1),
        output_dict=output_dict, init_logit_bias=init_logit_bias,
    ).double().eval()


def dense_window(num_examples: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"image": torch.randn(num_examples, 3, 16, 16, generator=gen, dtype=torch.float64),
            "text": torch.randint(1, 100, (num_examples, 8), generator=gen)}


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_works_with_an_open_clip_model_on_dense_images(method):
    model, loss_fn = open_clip_model(), create_loss("clip")
    batch = dense_window(5)
    reference = full_batch_gradients(model, loss_fn, batch, scale=1.0)
    model.zero_grad(set_to_none=True)
    # a dense window scales by 1 whatever the mode
    stats = accumulate_gradients(model, loss_fn, split_batch(batch, [1, 4]), loss_scale="linear",
                                 reference_batch_size=64, method=method)
    assert stats.scale == 1.0
    assert failures(model, reference) == {}


@pytest.mark.parametrize("method", ["cache", "replay"])
@pytest.mark.parametrize("siglip", [False, True], ids=["clip", "siglip"])
def test_open_clip_model_with_its_default_tuple_output_gives_the_dict_output_gradient(method, siglip):
    # open_clip's CLIP returns (image_features, text_features, logit_scale[, logit_bias]) unless output_dict=True;
    # the window used to fail on it inside its own error message (sorted() over a tuple of tensors)
    model = open_clip_model(output_dict=False, init_logit_bias=-10.0 if siglip else None)
    loss_fn, batch = create_loss("siglip" if siglip else "clip"), dense_window(5)
    model.output_dict = True
    reference = full_batch_gradients(model, loss_fn, batch, scale=1.0)
    model.output_dict = False
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, loss_fn, split_batch(batch, [2, 3]), method=method)
    assert failures(model, reference) == {}
    if siglip:
        assert model.logit_bias.grad is not None


def test_a_model_output_that_is_neither_dict_nor_open_clip_tuple_is_one_line_naming_output_dict():
    class Features(torch.nn.Module):
        def forward(self, image=None, text=None):
            return torch.zeros(1)

    with pytest.raises(ValueError, match="output_dict=True") as info:
        accumulate_gradients(Features(), loss_for(False), [dense_window(2)])
    assert "\n" not in str(info.value) and "Tensor" in str(info.value)


def test_dense_input_through_the_naflex_model():
    model = tiny_model(False)
    out = model(image=torch.randn(2, 3, 20, 12, dtype=torch.float64), text=torch.randint(1, 100, (2, 16)))
    assert out["image_features"].shape == (2, 16)


def window_error(microbatches, **kwargs) -> str:
    with pytest.raises(ValueError) as info:
        accumulate_gradients(tiny_model(False), loss_for(False), microbatches, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_mixed_dense_and_naflex_window_is_an_error():
    naflex = split_batch(naflex_window(2), [2])[0]
    dense = {"image": torch.randn(2, 3, 8, 8, dtype=torch.float64), "text": naflex["text"]}
    assert "['naflex', 'dense']" in window_error([naflex, dense])


def test_empty_window_and_empty_microbatch_are_errors():
    assert "empty window" in window_error([])
    batch = naflex_window(2)
    empty = {"image": {k: v[:0] for k, v in batch["image"].items()}, "text": batch["text"][:0]}
    assert "batch size 0" in window_error([batch, empty])


def test_scale_errors_and_unknown_method_name_the_value():
    batch = naflex_window(2)
    assert "None" in window_error([batch], loss_scale="linear")
    assert "-3" in window_error([batch], loss_scale="sqrt", reference_batch_size=-3)
    assert "'grad-cache'" in window_error([batch], method="grad-cache")
    assert "'quadratic'" in window_error([batch], loss_scale="quadratic", reference_batch_size=2)


def test_image_and_text_row_mismatch_is_an_error():
    batch = naflex_window(3)
    assert "3 images but 2 texts" in window_error([{"image": batch["image"], "text": batch["text"][:2]}])


def test_model_without_feature_outputs_is_an_error():
    class NoText(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = tiny_model(False)

        def forward(self, image, text):
            out = self.inner(image=image, text=text)
            del out["text_features"]
            return out

    with pytest.raises(ValueError, match="'text_features'"):
        accumulate_gradients(NoText(), loss_for(False), [naflex_window(2)])


def test_concat_then_split_round_trips_rows():
    batch = naflex_window(5)
    pieces = split_batch(batch, [2, 3])
    again = concat_microbatches(pieces)
    assert torch.equal(again["text"], batch["text"])
    valid = batch["image"]["patch_valid"]
    assert torch.equal(again["image"]["patches"][valid], batch["image"]["patches"][valid])


@pytest.mark.parametrize("method", ["cache", "replay"])
def test_an_open_clip_collated_window_with_an_integer_seq_len_gives_the_same_gradient(method):
    # OpenCLIP's NaFlex collator adds the batch's sequence length to the image dict as a plain int
    model, loss_fn, batch = tiny_model(False), loss_for(False), naflex_window(5, seed=8)
    microbatches = split_batch(batch, [2, 3])
    grads = {}
    for collated in (False, True):
        if collated:
            microbatches = [{**mb, "image": {**mb["image"], "seq_len": mb["image"]["patches"].shape[1]}}
                            for mb in microbatches]
        model.zero_grad(set_to_none=True)
        accumulate_gradients(model, loss_fn, microbatches, loss_scale="linear", reference_batch_size=2, method=method)
        grads[collated] = collect_gradients(model)
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        assert torch.equal(grads[True][name], grad), name
    assert to_device(microbatches[0], "cpu")["image"]["seq_len"] == microbatches[0]["image"]["patches"].shape[1]
