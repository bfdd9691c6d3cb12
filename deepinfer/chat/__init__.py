"""Chat formatting: a conversation of vLLM-shaped messages in, the prompt the model was trained on out.

``formats`` picks the model's format (its Jinja ``chat_template``, else the
DeepSeek-V4 encoder in ``deepseek_v4``) and encodes the text; ``messages`` checks
the input.
"""

from .formats import ChatFormat, ChatPrompt, DeepseekV4Format, JinjaFormat, chat_format_for, encode_prompt, format_chat, has_v4_chat_tokens
from .messages import Conversation, Message, ToolCall, parse_conversation

__all__ = [
    "ChatFormat",
    "ChatPrompt",
    "Conversation",
    "DeepseekV4Format",
    "JinjaFormat",
    "Message",
    "ToolCall",
    "chat_format_for",
    "encode_prompt",
    "format_chat",
    "has_v4_chat_tokens",
    "parse_conversation",
]
