"""``deepinfer serve`` with images: chat content parts carrying a data URI reach the engine expanded into
spans; a bad image is a 400 OpenAI error for that request only; the model card says the model reads images."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.servers import running_server
from tests.helpers.tiny_images import PLACEHOLDER, data_uri, gradient_image, write_image_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-images")
    directory, _ = write_image_checkpoint(root / "tiny")
    (root / "template.jinja").write_text(TEMPLATE)
    args = ["--model", str(directory), "--backend", "cpu", "--chat-template", str(root / "template.jinja"), "--max-model-len", "256"]
    with running_server(args, log_dir=root) as srv:
        yield srv


def _chat(server, content, **body) -> httpx.Response:
    payload = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0.0, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=payload, timeout=120)


def test_a_data_uri_image_reaches_the_engine(server):
    content = [{"type": "text", "text": "what is this? "}, {"type": "image_url", "image_url": {"url": data_uri(gradient_image(16, 16))}}]
    got = _chat(server, content)
    assert got.status_code == 200, got.text
    usage = got.json()["usage"]
    text_only = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": content}]}, timeout=60).json()
    assert usage["prompt_tokens"] == text_only["count"] - 1 + 8  # the placeholder became a span of 8
    assert usage["completion_tokens"] == 2


def test_tokenize_renders_the_placeholder(server):
    content = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": data_uri(gradient_image(16, 16))}]
    got = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": content}]}, timeout=60)
    assert got.status_code == 200
    ids = got.json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert text == f"user: a{PLACEHOLDER}\nassistant:"


def test_bad_images_are_400s_and_the_server_goes_on(server):
    cases = [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "the image data is in no format Pillow reads"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "remote image URLs are not fetched"),
        ([{"type": "image_url", "image_url": {"url": "/no/such/cat.png"}}], "image file '/no/such/cat.png' does not exist"),
        ([{"type": "image_url", "image_url": {}}], "message 0 (user) has an image_url part without a url"),
    ]
    for content, start in cases:
        got = _chat(server, content)
        assert got.status_code == 400, (content, got.text)
        error = got.json()["error"]
        assert error["message"].startswith(start) and error["param"] == "messages" and error["type"] == "invalid_request_error"
        assert "\n" not in error["message"]
    typed = _chat(server, [{"type": "text", "text": f"look: {PLACEHOLDER}"}])  # a placeholder typed as text, no image
    assert typed.status_code == 400 and typed.json()["error"]["message"].startswith("the prompt has 1 image placeholders")
    ok = _chat(server, "hello")
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_the_model_card_says_it_reads_images(server):
    info = httpx.get(server.url + "/model_info", timeout=30).json()
    assert info["has_image_understanding"] is True and info["model_type"] == "deepseek_v41"


def test_spans_count_in_streamed_usage_and_the_context_check(server):
    content = [{"type": "text", "text": "what is this? "}, {"type": "image_url", "image_url": {"url": data_uri(gradient_image(16, 16))}}]
    text_only = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": content}]}, timeout=60).json()
    payload = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0.0, "stream": True,
               "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=payload, timeout=120) as got:
        events = [json.loads(line[6:]) for line in got.iter_lines() if line.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens"] == text_only["count"] - 1 + 8
    # nine images of 32 span tokens each: short text, but past the 256-token context once expanded
    big = [{"type": "image_url", "image_url": {"url": data_uri(gradient_image(64, 64, seed=i))}} for i in range(9)]
    got = _chat(server, big)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert "with its images' spans but max_model_len is 256" in error["message"] and error["param"] == "messages"


def test_responses_and_messages_images_reach_the_engine_as_chat_does(server):
    """An ``input_image`` (Responses) and a base64 ``image`` block (Anthropic Messages) become the chat image part:
    the same prompt, spans and greedy reply as through ``/v1/chat/completions``."""
    uri = data_uri(gradient_image(16, 16))
    # each from an empty prefix cache: a prompt with an image computed after a prefix hit is not the same yet
    httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
    chat = _chat(server, [{"type": "text", "text": "what is this? "}, {"type": "image_url", "image_url": {"url": uri}}]).json()
    httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
    responses = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this? "}, {"type": "input_image", "image_url": uri}]}],
        "max_output_tokens": 2, "temperature": 0.0}).json()
    media, data = uri.removeprefix("data:").split(";base64,")
    conversation = [{"role": "user", "content": [{"type": "text", "text": "what is this? "},
                                                 {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}]}]
    httpx.post(server.url + "/flush_cache", timeout=60).raise_for_status()
    messages = httpx.post(server.url + "/v1/messages", timeout=120, json={"messages": conversation, "max_tokens": 2, "temperature": 0.0}).json()
    counted = httpx.post(server.url + "/v1/messages/count_tokens", timeout=120, json={"messages": conversation}).json()
    assert responses["usage"]["input_tokens"] == messages["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    assert counted["input_tokens"] == chat["usage"]["prompt_tokens"]
    text = chat["choices"][0]["message"]["content"]
    assert responses["output"][-1]["content"][0]["text"] == messages["content"][-1]["text"] == text
