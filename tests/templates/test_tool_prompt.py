"""Tools written into the conversation for templates that don't know about them."""

from bubo.templates.tool_prompt import with_tools_in_messages

CALL = {"id": "c1", "type": "function", "function": {"name": "look", "arguments": '{"at": "it"}'}}


def test_tool_results_after_a_turn_with_images_start_a_user_turn() -> None:
    # A user turn with images holds a list of parts: the result must not be joined onto it as text.
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    messages = [
        {"role": "user", "content": parts},
        {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
    ]
    out = with_tools_in_messages(messages, None)
    assert out[0] == messages[0]
    assert out[1] == {"role": "user", "content": "<tool_response>\na cat\n</tool_response>"}


def test_consecutive_tool_results_join_one_user_turn() -> None:
    messages = [
        {"role": "user", "content": "look twice"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c1", "content": "two"},
    ]
    out = with_tools_in_messages(messages, [{"type": "function", "function": {"name": "look"}}])
    assert out[0]["role"] == "system" and '"name": "look"' in out[0]["content"]
    assert out[2]["content"].count("<tool_call>") == 2
    assert out[3:] == [
        {
            "role": "user",
            "content": "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>",
        }
    ]
