#!/usr/bin/env python3
"""Writes the committed fuzz seeds (tests/fuzz/seeds/<target>/<name>): real frames and events
of the Copilot runtime's protocol (shapes from the design reference's copilot-protocol.md),
deeply nested JSON, and huge Content-Length headers. Run from anywhere; rewrites the seeds.
tests/fuzz_seeds.rs replays every seed through the same entry points as the fuzzer."""
import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")


def w(target, name, data):
    os.makedirs(os.path.join(HERE, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(HERE, target, name), "wb") as f:
        f.write(data)


def frame(obj):
    body = obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode()
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


# The runtime's answer to `connect`, byte for byte as captured (copilot-protocol.md §3).
CONNECT_RESULT = b'{"jsonrpc":"2.0","id":1,"result":{"ok":true,"protocolVersion":3,"version":"1.0.102","taskKinds":["agent","shell"]}}'
assert len(CONNECT_RESULT) == 115

EV_MSG = {"id": "3f1c2a8e-0b7d-4e55-9c1e-2f8a6d0b9e11", "timestamp": "2026-05-01T10:00:00.000Z", "parentId": None,
          "type": "assistant.message",
          "data": {"messageId": "m-1", "content": "hello",
                   "toolRequests": [{"toolCallId": "call-1", "name": "bash", "arguments": {"command": "ls"}, "type": "function"}]}}
EV_IDLE = {"id": "e2", "timestamp": "2026-05-01T10:00:01.000Z", "parentId": EV_MSG["id"], "ephemeral": True,
           "type": "session.idle", "data": {"aborted": False}}
EV_TOOL = {"id": "e3", "type": "external_tool.requested",
           "data": {"requestId": "r-1", "sessionId": "s-1", "toolCallId": "call-1", "toolName": "lookup", "arguments": {"q": "x"}}}
EV_ERR = {"id": "e4", "type": "session.error",
          "data": {"errorType": "model_call", "message": "Execution failed: InvalidArg, No GitHub OAuth token or Copilot HMAC key provided", "statusCode": 401}}
EV_UNKNOWN = {"id": "e5", "type": "model.call_start", "ephemeral": True, "data": {"x": 1}}
EV_MISMATCH = {"id": "e6", "type": "assistant.message", "data": {"messageId": 7}}
DEEP = "[" * 5000 + "]" * 5000
DEEP_OBJ = '{"a":' * 3000 + "1" + "}" * 3000


def event_note(ev):
    return {"jsonrpc": "2.0", "method": "session.event", "params": {"sessionId": "s-1", "event": ev}}


# Frame codec: the first byte is the control byte (low 6 bits: piece size - 1; 0x40: 1 KiB limit).
w("frame_codec", "connect_result_whole", b"\x3f" + frame(CONNECT_RESULT))
w("frame_codec", "connect_result_byte_by_byte", b"\x00" + frame(CONNECT_RESULT))
w("frame_codec", "content_type_and_two_frames",
  b"\x07" + b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\ncontent-length: 2\r\n\r\n[]" + frame(event_note(EV_IDLE)))
w("frame_codec", "huge_content_length", b"\x3f" + b"Content-Length: 67108864\r\n\r\n{\"jsonrpc\":")
w("frame_codec", "content_length_overflow", b"\x3f" + b"Content-Length: 99999999999999999999999\r\n\r\n")
w("frame_codec", "too_large_for_small_limit", b"\x7f" + b"Content-Length: 2048\r\n\r\n" + b"x" * 64)
w("frame_codec", "truncated_body", b"\x03" + b"Content-Length: 10\r\n\r\n{}")
w("frame_codec", "no_header_end", b"\x3f" + b"Content-Length: 2\r\nX: " + b"y" * 200)

# JSON-RPC: the peer's byte stream (our three waiting requests have ids 1, 2 and 3).
w("json_rpc", "connect_result", frame(CONNECT_RESULT))
w("json_rpc", "event_stream", frame(event_note(EV_MSG)) + frame(event_note(EV_IDLE)) + frame(event_note(EV_TOOL)))
w("json_rpc", "server_requests",
  frame({"jsonrpc": "2.0", "id": 1, "method": "userInput.request",
         "params": {"sessionId": "s-1", "question": "Proceed?", "choices": ["yes", "no"], "allowFreeform": True}})
  + frame({"jsonrpc": "2.0", "id": 2, "method": "hooks.invoke",
           "params": {"sessionId": "s-1", "hookType": "preToolUse", "input": {"toolName": "bash"}}})
  + frame({"jsonrpc": "2.0", "id": "three", "method": "exitPlanMode.request", "params": {"sessionId": "s-1"}})
  + frame({"jsonrpc": "2.0", "id": 4, "method": "llmInference.httpRequestStart",
           "params": {"requestId": "q-1", "method": "POST", "url": "https://example.invalid/v1/chat/completions",
                      "headers": {"content-type": ["application/json"]}, "sessionId": "s-1"}})
  + frame({"jsonrpc": "2.0", "id": 5, "method": "llmInference.httpRequestChunk",
           "params": {"requestId": "q-1", "data": "{}", "end": True}}))
w("json_rpc", "responses_to_our_calls",
  frame({"jsonrpc": "2.0", "id": 2, "result": {"ok": True}})
  + frame({"jsonrpc": "2.0", "id": 3, "error": {"code": -32601, "message": "Method not found"}})
  + frame({"jsonrpc": "2.0", "id": 1, "error": "not an object"}))
w("json_rpc", "duplicate_request_ids", frame({"jsonrpc": "2.0", "id": 9, "method": "a", "params": None}) * 3)
w("json_rpc", "deeply_nested_params", frame(b'{"jsonrpc":"2.0","method":"session.event","params":' + DEEP.encode() + b"}"))
# Session events as the worker's reader splits them off, and what must not come split.
w("json_rpc", "session_event_shapes",
  frame(b'{"params":{"event":{"type":"x"},"sessionId":"s-2"},"method":"session.event"}')
  + frame(b'{"method":"x","params":{"sessionId":"s-3","event":{}},"method":"session.event"}')
  + frame(b'{"\\u006dethod":"session.event","params":{"sessionId":"s-4","event":{}}}')
  + frame(b'{"id":null,"method":"session.event","params":{"sessionId":"s-5"}}')
  + frame(b'{"method":"session.event","params":{"sessionId":7,"event":{}}}')
  + frame(b'{"method":"session.event","params":["s-6",{"type":"y"}]}')
  + frame(b'{"method":"session.event"}')
  + frame(b'{"id":10,"method":"session.event","params":{"sessionId":"s-7","event":{}}}')
  + frame(b'{"method":"session.event","params":{"sessionId":7},"x":}'))
# Requests as the runtime writes them (id and method first: their params read as a value in the
# frame's one pass), params at serde_json's depth limit and past it.
w("json_rpc", "requests_read_in_one_pass",
  frame(b'{"jsonrpc":"2.0","id":11,"method":"llmInference.httpRequestChunk","params":{"requestId":"r","data":"{\\"a\\":\\"\\\\u00e9\\"}","end":true}}')
  + frame(b'{"jsonrpc":"2.0","id":12,"method":"deep","params":' + b"[" * 127 + b"]" * 127 + b"}")
  + frame(b'{"jsonrpc":"2.0","id":13,"method":"deeper","params":' + b"[" * 128 + b"]" * 128 + b"}")
  + frame(b'{"jsonrpc":"2.0","id":14,"method":"a","params":{"k":1,"k":2},"method":"b"}'))
# Found by the fuzzer: a byte that is not UTF-8 in a string of a params member nobody reads.
# Read as the params' text, the frame breaks the stream; read in the frame's pass, it must too.
w("json_rpc", "invalid_utf8_in_an_unknown_params_member",
  frame(b'{"jsonrpc":"2.0","method":"session.event","params":{"sessionId":"s-1","evenp":{"type":"session\xaeidle"}}}')
  + frame(event_note(EV_TOOL)))
w("json_rpc", "not_json", frame(b'{"jsonrpc":"2.0",'))
w("json_rpc", "huge_content_length", b"Content-Length: 67108864\r\n\r\n{}")

# Session events: one event's JSON.
for name, ev in [("assistant_message", EV_MSG), ("session_idle", EV_IDLE), ("external_tool_requested", EV_TOOL),
                 ("session_error", EV_ERR), ("unknown_model_event", EV_UNKNOWN), ("known_type_wrong_data", EV_MISMATCH)]:
    w("session_event", name, json.dumps(ev))
# As the runtime writes events: type first, then data, then the rest (an untyped one is read no
# further than its type until its envelope is asked for).
w("session_event", "runtime_order_untyped", '{"type":"model.messages_snapshot","data":{"messages":[{"role":"system","content":"a \\"b\\"\\n"}]},"id":"e8","timestamp":"2026-12-04T00:00:00.000Z","parentId":"e7","ephemeral":true}')
w("session_event", "runtime_order_typed", '{"type":"session.idle","data":{"aborted":true},"id":"e9","parentId":"e8","ephemeral":true}')
w("session_event", "runtime_order_type_twice", '{"type":"model.call","data":{},"type":"session.idle"}')
w("session_event", "runtime_order_envelope_unread", '{"type":"model.call","data":{"x":1},"id":5}')
w("session_event", "not_an_object", '["assistant.message"]')
w("session_event", "deeply_nested_array", DEEP)
w("session_event", "deeply_nested_data", '{"id":"e7","type":"assistant.message","data":' + DEEP_OBJ + "}")
# Found by the fuzzer: a key twice in a tool request; it decodes as a JSON value reads it (the
# last one counts), as its wire form does.
w("session_event", "duplicate_key_in_a_tool_request", '{"id": "3f1c2a8e-0b7d-4e55-9c1e-2f8a6d0b9e11", "timestamp": "2026-05-01T10:00:00.000Z", "pareEtId": null, "type": "assistant.message", "data": {"outputTok": "m-1", "c2ntent": "hello", "toolRequests": [{"toolCallId": "call-1", "type": "bash", "arg%uments": {"command": "ls"}, "type": "function"}]}}')


# Transcript files (one JSON object per line).
def line(**kw):
    return json.dumps(kw, separators=(",", ":")) + "\n"


GOOD = line(id="ev-1", ts=1, role="user", content="hi") + line(id="ev-2", ts=2, role="assistant", content="hello")
w("transcript_reader", "two_lines", GOOD)
w("transcript_reader", "torn_last_line", GOOD + '{"id":"ev-3","ts":3,"role":"assist')
w("transcript_reader", "invalid_middle_line",
  line(id="ev-1", ts=1, role="user", content="a") + "not json\n" + line(id="ev-2", ts=2, role="user", content="b"))
w("transcript_reader", "duplicate_ids", line(id="ev-1", ts=1, role="user", content="a") * 2)
w("transcript_reader", "holds_the_appended_id", line(id="fuzz-entry-id", ts=1, role="user", content="fuzz"))
w("transcript_reader", "deeply_nested_line", DEEP + "\n")
w("transcript_reader", "blank_and_crlf_lines", "\n  \n" + GOOD.replace("\n", "\r\n"))

# HTTP request bodies (POST /v1/turns, compact, reset).
w("http_body", "turn_minimal", json.dumps({"agent_id": "agent-1", "session_key": "conv-1", "prompt": "REPLY=hello"}))
w("http_body", "turn_full", json.dumps({
    "agent_id": "agent-1", "session_key": "conv-1", "prompt": "hi", "model": "m", "reasoning_effort": "low",
    "provider": {"type": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key": "sk-fuzz", "max_output_tokens": 1000,
                 "headers": {"x-a": "b"}},
    "auth": {"github_token": "ghp_fuzz", "profile_id": "p", "profile_version": "1"},
    "session": {"workingDirectory": "/nonexistent/copilot-pool-fuzz/work/sub", "additionalDirectories": ["../../etc"],
                "mcpServers": {"local": {"type": "local", "command": "sh", "args": []}}},
    "tools": [{"name": "lookup", "description": "d", "parameters": {"type": "object"}}, {"name": "lookup"}],
    "attachments": [{"type": "file", "path": "../../../etc/passwd"},
                    {"type": "inline", "data": "aGVsbG8=", "media_type": "text/plain", "name": "../x.txt"},
                    {"type": "directory", "path": "."}],
    "timeout_ms": 0, "mode": "immediate", "agentMode": "plan", "hooks": ["preToolUse"]}))
w("http_body", "compact_with_provider", json.dumps({
    "custom_instructions": "keep names",
    "provider": {"type": "azure", "base_url": "https://x.openai.azure.com", "azure": {"api_version": "2024-10-21"},
                 "max_prompt_tokens": -1}}))
w("http_body", "reset_empty", "")
w("http_body", "null_body", "null")
w("http_body", "sdk_session_key", json.dumps({"agent_id": "A", "session_key": "sdk:abc", "prompt": ""}))
w("http_body", "deeply_nested_session", '{"agent_id":"a","session_key":"k","prompt":"p","session":' + DEEP_OBJ + "}")
