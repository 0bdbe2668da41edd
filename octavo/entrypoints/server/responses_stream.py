"""The events of a streamed /v1/responses answer: chat deltas -> OpenAI's output-item events
(added, content part added, deltas, done, content part done, item done), each numbered by
`sequence_number` and named in its SSE `event:` line, as vLLM's simple (non-harmony) stream
sends them.

Must not: touch the engine or the chat run; it only shapes what it is fed.
"""

from __future__ import annotations

import json
from typing import Any

from octavo.entrypoints.server.protocol_responses import ResponsesRequest
from octavo.entrypoints.server.responses_items import (
    function_call_item,
    item_id,
    message_item,
    reasoning_item,
)


class EventWriter:
    """SSE events, `event:` named by their type, numbered from 0 in the order sent."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def send(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"


class StreamItems:
    """Chat deltas -> the output items' events. One item is open at a time (thinking, text,
    or one function call); a delta of another kind, or of another call, closes it and opens
    the next, as vLLM's simple (non-harmony) stream does."""

    def __init__(self, events: EventWriter, request: ResponsesRequest) -> None:
        self.events = events
        self.request = request
        self.output: list[dict[str, Any]] = []
        self.kind: str | None = None  # "reasoning", "message", "function_call" or None
        self.item_id = ""
        self.text = ""
        self.call: dict[str, Any] = {}  # the open call's call_id, name and index

    def feed(self, delta: Any) -> list[str]:
        sent: list[str] = []
        if delta.reasoning and self.request.include_reasoning:
            sent += self._switch("reasoning")
            sent.append(self._delta("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            sent += self._switch("message")
            sent.append(self._delta("response.output_text.delta", delta.content, logprobs=[]))
        for call in delta.tool_calls or []:
            if self.request.parallel_tool_calls is False and call.index > 0:
                continue
            if call.id is not None:
                sent += self._switch(None)
                name = call.function.name if call.function else ""
                sent += self._open_call(call.id, name, call.index)
            arguments = call.function.arguments if call.function else None
            if arguments:
                sent.append(self._delta("response.function_call_arguments.delta", arguments))
        return sent

    def _delta(self, kind: str, text: str, **extra: Any) -> str:
        self.text += text
        return self.events.send(
            kind,
            item_id=self.item_id,
            output_index=len(self.output),
            **({} if kind == "response.function_call_arguments.delta" else {"content_index": 0}),
            delta=text,
            **extra,
        )

    def _switch(self, kind: str | None) -> list[str]:
        if self.kind == kind:
            return []
        sent = self.close()
        if kind == "message":
            self._open(
                "msg",
                message_item("", "", "in_progress"),
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                sent,
            )
        elif kind == "reasoning":
            self._open(
                "rs",
                reasoning_item("", "", "in_progress"),
                {"type": "reasoning_text", "text": ""},
                sent,
            )
        self.kind = kind
        return sent

    def _open(
        self, prefix: str, item: dict[str, Any], part: dict[str, Any], sent: list[str]
    ) -> None:
        self.item_id = item_id(prefix)
        self.text = ""
        item["id"] = self.item_id
        if item["type"] == "reasoning":
            item["content"] = []
        output_index = len(self.output)
        sent.append(
            self.events.send("response.output_item.added", output_index=output_index, item=item)
        )
        sent.append(
            self.events.send(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=output_index,
                content_index=0,
                part=part,
            )
        )

    def _open_call(self, call_id: str, name: str, index: int) -> list[str]:
        self.kind = "function_call"
        self.item_id = item_id("fc")
        self.text = ""
        self.call = {"call_id": call_id, "name": name, "index": index}
        item = function_call_item(self.item_id, call_id, name, "", "in_progress")
        return [
            self.events.send("response.output_item.added", output_index=len(self.output), item=item)
        ]

    def close(self) -> list[str]:
        """The open item's done events; nothing when none is open."""
        kind, self.kind = self.kind, None
        output_index = len(self.output)
        where = {"item_id": self.item_id, "output_index": output_index}
        if kind == "message":
            item = message_item(self.item_id, self.text, "completed")
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": None}
            sent = [
                self.events.send(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                ),
                self.events.send("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif kind == "reasoning":
            item = reasoning_item(self.item_id, self.text, "completed")
            part = {"type": "reasoning_text", "text": self.text}
            sent = [
                self.events.send(
                    "response.reasoning_text.done", **where, content_index=0, text=self.text
                ),
                self.events.send("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif kind == "function_call":
            item = function_call_item(
                self.item_id, self.call["call_id"], self.call["name"], self.text, "completed"
            )
            sent = [
                self.events.send(
                    "response.function_call_arguments.done",
                    **where,
                    name=self.call["name"],
                    arguments=self.text,
                )
            ]
        else:
            return []
        sent.append(
            self.events.send("response.output_item.done", output_index=output_index, item=item)
        )
        self.output.append(item)
        return sent
