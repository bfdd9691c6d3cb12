"""Images through the engine's front doors: vLLM's multimodal prompt in ``generate`` / ``add_request``,
OpenAI content parts in ``LLM.chat``; placeholders expanded into spans on the request; every bad image,
count or model a one-line error of its own request."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.multimodal import ImageGrid
from tests.helpers.tiny_images import PLACEHOLDER, data_uri, gradient_image, png_bytes, write_image_checkpoint

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PARAMS = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_image_checkpoint(tmp_path_factory.mktemp("v41img") / "tiny")


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt[0]), backend="cpu", max_model_len=128, max_images_per_prompt=2, enforce_eager=True)


def _expect_run(out) -> None:
    """An image request ran to its token limit."""
    assert out.error is None and len(out.outputs[0].token_ids) == PARAMS.max_tokens


def test_placeholders_expand_into_spans_on_the_request(llm, ckpt):
    _, image_id = ckpt
    engine = llm.engine
    # 16 x 16 is the tiny config's minimum area: 4 x 4 patches, 2 x 2 tokens, a span of 8; 32 x 16: 2 x 4 tokens, 12
    prompt = {"prompt_token_ids": [5, image_id, 6, 7, image_id, 8],
              "multi_modal_data": {"image": [gradient_image(16, 16), data_uri(gradient_image(32, 16, seed=1))]}}
    req = engine.add_request(prompt, SamplingParams(n=2, max_tokens=2))
    assert [(s.offset, s.length, s.grid) for s in req.images] == [(1, 8, ImageGrid(4, 4, 2, 2)), (11, 12, ImageGrid(4, 8, 2, 4))]
    assert req.prompt_token_ids.tolist() == [5] + [image_id] * 8 + [6, 7] + [image_id] * 12 + [8]
    # the forks share the spans
    assert req.error is None and len(req.siblings) == 2 and all(s.images is req.images for s in req.siblings)
    engine.abort(req.request_id)
    engine.release([req.request_id])


def test_text_in_the_prompt_carries_the_placeholder(llm, ckpt):
    _, image_id = ckpt
    read = llm.engine.prompts.read({"prompt": f"look {PLACEHOLDER} here", "multi_modal_data": {"image": png_bytes(gradient_image(16, 16))}})
    assert read.text == f"look {PLACEHOLDER} here" and read.token_ids.count(image_id) == 8
    assert read.images[0].offset == read.token_ids.index(image_id)


def test_a_bad_image_fails_its_own_request_only(llm, ckpt):
    _, image_id = ckpt
    good = {"prompt_token_ids": [5, image_id, 6], "multi_modal_data": {"image": gradient_image(16, 16)}}
    outs = llm.generate([
        good,
        {"prompt_token_ids": [5, image_id, 6], "multi_modal_data": {"image": b"not an image"}},
        {"prompt_token_ids": [5, image_id, 6], "multi_modal_data": {"image": "https://example.com/cat.png"}},
        {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": gradient_image(16, 16)}},
        {"prompt_token_ids": [image_id] * 3, "multi_modal_data": {"image": [gradient_image(16, 16)] * 3}},
        {"prompt_token_ids": [5, image_id], "multi_modal_data": {"video": b"..."}},
        [5, 6, 7, 8],
    ], PARAMS)
    _expect_run(outs[0])
    assert outs[1].error == "the image data is in no format Pillow reads; send a PNG, JPEG, WebP, GIF or BMP image"
    assert outs[2].error.startswith("remote image URLs are not fetched ('https://example.com/cat.png')")
    assert outs[3].error == f"the prompt has 0 image placeholders (token {image_id}) but 1 images; put one placeholder where each image goes"
    assert outs[4].error.startswith("the prompt has 3 images but max_images_per_prompt is 2")
    assert outs[5].error == "multi_modal_data has 'video'; this engine reads 'image' only"
    assert outs[6].error is None and len(outs[6].outputs[0].token_ids) == 2
    assert all(not o.outputs[0].token_ids for o in outs[1:6])


def test_the_length_check_counts_the_expanded_spans(llm, ckpt):
    _, image_id = ckpt
    # 64 x 64: 16 x 16 patches, 8 x 8 tokens (74 > the budget of 40): shrunk with max_w = sqrt(38 + 0.25) - 0.5 = 5.68,
    # beta = 5 · 8 / 64 -> 40 px = 10 x 10 patches, 5 x 5 tokens: a span of 32
    ids = [5] * 70 + [image_id] * 2
    read = llm.engine.prompts.read({"prompt_token_ids": ids, "multi_modal_data": {"image": [gradient_image(64, 64)] * 2}})
    assert [s.grid for s in read.images] == [ImageGrid(10, 10, 5, 5)] * 2 and len(read.token_ids) == 70 + 2 * 32
    out = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": [gradient_image(64, 64)] * 2}}], PARAMS)[0]
    assert out.error == "the prompt has 134 tokens but max_model_len is 128; shorten the prompt or raise max_model_len"


def test_chat_content_parts_put_the_placeholder_where_each_image_was(llm, ckpt, tmp_path):
    _, image_id = ckpt
    path = tmp_path / "cat.png"
    path.write_bytes(png_bytes(gradient_image(16, 16)))
    conversation = [{"role": "user", "content": [
        {"type": "text", "text": "compare "}, {"type": "image_url", "image_url": {"url": data_uri(gradient_image(32, 16))}},
        {"type": "text", "text": " with "}, {"type": "image_url", "image_url": str(path)},
    ]}]
    prompt = llm.format_chat(conversation, chat_template=TEMPLATE)[0]
    assert prompt.text == f"user: compare {PLACEHOLDER} with {PLACEHOLDER}\nassistant:"
    assert prompt.token_ids.count(image_id) == 2 and prompt.images == (conversation[0]["content"][1]["image_url"]["url"], str(path))
    out = llm.chat(conversation, PARAMS, chat_template=TEMPLATE)[0]
    assert out.prompt == prompt.text
    expected = llm.engine.prompts.read(prompt.engine_prompt()).token_ids
    assert len(expected) == len(prompt.token_ids) - 2 + 12 + 8
    assert out.prompt_token_ids == expected
    _expect_run(out)


def test_chat_with_a_bad_image_fails_that_conversation_only(llm):
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    fine = [{"role": "user", "content": "hello"}]
    outs = llm.chat([bad, fine], PARAMS, chat_template=TEMPLATE)
    assert outs[0].error.startswith("the image data is in no format Pillow reads") and outs[1].error is None


def test_a_checkpoint_without_a_vision_tower_refuses_images_per_request(tmp_path):
    directory, image_id = write_image_checkpoint(tmp_path / "novision", vision=None)
    llm = LLM(model=str(directory), backend="cpu", enforce_eager=True)
    image, text = llm.generate([{"prompt_token_ids": [5, image_id], "multi_modal_data": {"image": gradient_image(16, 16)}}, [5, 6]], PARAMS)
    assert image.error == "this checkpoint reads no images: its config.json has no vision_config; send text only"
    assert text.error is None
    # the chat format writes no placeholder for a model that reads no images; the image still reaches the engine, refused
    conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "x.png"}]}]
    assert llm.format_chat(conv, chat_template=TEMPLATE)[0].text == "user: hi\nassistant:"
    assert llm.chat(conv, PARAMS, chat_template=TEMPLATE)[0].error == image.error


def test_a_text_only_family_keeps_its_refusal():
    llm = LLM(backend="cpu", enforce_eager=True)
    out = llm.generate([{"prompt": "hi", "multi_modal_data": {"image": gradient_image(16, 16)}}], PARAMS)[0]
    assert out.error == "images are not supported: DeepSeek-V4 is a text-only model; send text only"
    conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": "x.png"}]}]
    assert llm.chat(conv, PARAMS)[0].error == out.error
