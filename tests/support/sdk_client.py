# The official Python SDK (github-copilot-sdk, installed by tests/support/python_sdk.rs)
# attached to copilot-pool's SDK endpoint by URL, as a gateway would: one scenario per run,
# chosen by SCENARIO. Each step prints one JSON line on stdout; the Rust test reads and
# checks them (and, for `crash`, kills the process of the session when told `streaming`).
#
# Environment: SDK_URL ("127.0.0.1:PORT"), SDK_TOKEN, MODEL_URL (the scripted model's base
# URL), MODEL_ID, SCENARIO (`turns`, `crash`).

import asyncio
import json
import os
import sys
import traceback

from pydantic import BaseModel

from copilot import CopilotClient, define_tool
from copilot.client import RuntimeConnection
from copilot.rpc import PermissionDecisionApproveOnce


def env(name):
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"{name} is not set")
    return value


def say(obj):
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def kind(event):
    return event.raw_type or event.type.value


async def within(seconds, awaitable, what):
    # Every wait is bounded: a scenario that hangs fails instead.
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise RuntimeError(f"{what}: no answer within {seconds} s") from None


def client():
    return CopilotClient(
        connection=RuntimeConnection.for_uri(env("SDK_URL"), connection_token=env("SDK_TOKEN"))
    )


def provider():
    return {"type": "openai", "base_url": env("MODEL_URL"), "api_key": "scripted-key"}


class SecretParams(BaseModel):
    key: str


@define_tool(
    name="get_secret_number",
    description="Returns the secret number for a key",
    skip_permission=True,
)
async def secret_tool(params: SecretParams) -> str:
    return f"secret number for {params.key} is 42"


class NoParams(BaseModel):
    pass


@define_tool(name="lookup_colour", description="Returns the colour of the day")
async def colour_tool(params: NoParams) -> str:
    return "colour of the day is teal"


async def turns():
    c = client()
    await within(10, c.start(), "start")
    permissions = []
    questions = []
    prompts = []

    def on_permission(request, invocation):
        permissions.append(getattr(request, "kind", None) and str(request.kind.value if hasattr(request.kind, "value") else request.kind))
        return PermissionDecisionApproveOnce()

    async def on_user_input(request, invocation):
        questions.append({"question": request["question"], "choices": request.get("choices")})
        return {"answer": "blue", "wasFreeform": False}

    async def on_prompt(input, invocation):
        prompts.append(input["prompt"])
        if "HOOK-ME" in input["prompt"]:
            return {"modifiedPrompt": "REPLY=rewritten by the hook"}
        return None

    session = await c.create_session(
        on_permission_request=on_permission,
        model=env("MODEL_ID"),
        provider=provider(),
        tools=[secret_tool, colour_tool],
        on_user_input_request=on_user_input,
        hooks={"on_user_prompt_submitted": on_prompt},
        streaming=True,
    )
    seen = []
    session.on(lambda e: seen.append(kind(e)))

    # A tool turn: the model calls the SDK's tool, the SDK answers, the model reads it.
    tool = await session.send_and_wait('SCENARIO:tool NAME=get_secret_number ARGS={"key":"alpha"}', timeout=30)
    say({
        "step": "tool",
        "sessionId": session.session_id,
        "content": tool.data.content if tool else None,
        "toolRequested": "external_tool.requested" in seen,
    })

    # A permission prompt answered by the SDK's handler.
    perm = await session.send_and_wait("SCENARIO:tool NAME=lookup_colour ARGS={}", timeout=30)
    say({"step": "permission", "permissions": permissions, "content": perm.data.content if perm else None})

    # ask_user answered by the SDK's handler.
    ask = await session.send_and_wait(
        'SCENARIO:tool NAME=ask_user ARGS={"question":"Pick a colour","choices":["red","blue"],"allow_freeform":false}',
        timeout=30,
    )
    say({"step": "ask_user", "questions": questions, "content": ask.data.content if ask else None})

    # A hook that rewrites the prompt.
    hooked = await session.send_and_wait("HOOK-ME please", timeout=30)
    say({"step": "hook", "prompts": prompts, "content": hooked.data.content if hooked else None})

    # Streaming: deltas arrive before the final message.
    deltas = []

    def on_delta(e):
        if kind(e) == "assistant.message_delta":
            deltas.append(e.data.delta_content)

    off = session.on(on_delta)
    streamed = await session.send_and_wait("SCENARIO:slow SLOW=5x20", timeout=30)
    off()
    say({"step": "streaming", "deltas": "".join(deltas), "content": streamed.data.content if streamed else None})

    # Abort: a slow turn is aborted at its first delta and ends idle with aborted set.
    loop = asyncio.get_running_loop()
    first = loop.create_future()
    idle = loop.create_future()

    def on_abort_events(e):
        if kind(e) == "assistant.message_delta" and not first.done():
            first.set_result(True)
        if kind(e) == "session.idle" and first.done() and not idle.done():
            idle.set_result(e.data.aborted)

    off = session.on(on_abort_events)
    await session.send("SCENARIO:slow SLOW=200x100")
    await within(30, first, "first delta")
    await session.abort()
    aborted = await within(15, idle, "idle after abort")
    off()
    say({"step": "abort", "aborted": aborted})

    after = await session.send_and_wait("REPLY=still here", timeout=30)
    say({"step": "after-abort", "content": after.data.content if after else None})
    await session.disconnect()
    await c.stop()


async def crash():
    c = client()
    await within(10, c.start(), "start")
    session = await c.create_session(
        on_permission_request=lambda request, invocation: PermissionDecisionApproveOnce(),
        model=env("MODEL_ID"),
        provider=provider(),
        streaming=True,
    )
    first = await session.send_and_wait("REPLY=first answer", timeout=30)
    say({"step": "first", "sessionId": session.session_id, "content": first.data.content if first else None})

    loop = asyncio.get_running_loop()
    streaming = loop.create_future()
    idle_after_error = loop.create_future()
    errors = []
    order = []

    def watch(e):
        t = kind(e)
        if t == "assistant.message_delta" and not streaming.done():
            streaming.set_result(True)
        if t == "session.error":
            errors.append({"errorType": e.data.error_type, "message": e.data.message})
            order.append(t)
        if t == "session.idle" and errors and not idle_after_error.done():
            order.append(t)
            idle_after_error.set_result(e.data.aborted)

    off = session.on(watch)

    async def interrupted():
        try:
            m = await session.send_and_wait("SCENARIO:slow SLOW=300x100", timeout=60)
            return {"ok": True, "content": m.data.content if m else None}
        except Exception as e:  # the SDK's rejection
            return {"ok": False, "message": str(e)}

    turn = asyncio.ensure_future(interrupted())
    await within(30, streaming, "first delta")
    # The test kills the session's process now and times the rejection from the kill.
    say({"step": "streaming"})
    outcome = await within(30, turn, "the interrupted turn")
    say({"step": "rejected", "outcome": outcome, "errors": errors})
    aborted = await within(1, idle_after_error, "the idle after the error")
    off()
    say({"step": "idle", "aborted": aborted, "order": order})

    # The same session object goes on, on a fresh process, with its history.
    nxt = await session.send_and_wait("REPLY=after the crash", timeout=30)
    say({"step": "after", "content": nxt.data.content if nxt else None})
    await c.stop()


SCENARIOS = {"turns": turns, "crash": crash}


async def main():
    run = SCENARIOS.get(env("SCENARIO"))
    if run is None:
        raise RuntimeError(f"unknown SCENARIO {os.environ.get('SCENARIO')}")
    await run()


try:
    asyncio.run(main())
    say({"done": True})
    sys.exit(0)
except Exception:
    say({"error": traceback.format_exc()})
    sys.exit(1)
