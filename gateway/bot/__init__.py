"""Voice agents on our voices: a script hands the call to a company's bot over a
ConversationRelay-compatible WebSocket, and the bot's words stream into the engine as it writes.

- :mod:`.protocol`: ConversationRelay's messages both ways (sans-I/O), and the handshake's
  signature.
- :mod:`.connection`: the WebSocket to one bot (connect signed with certificates checked,
  send, receive, close).
- :mod:`.text`: the bot's streamed text read as the line reads its sentences, released a piece
  at a time where nothing later can change how it is read.
- :mod:`.talk`: one answer spoken as it is written (engine turns in Qwen3-TTS's streaming-text
  mode, or a sentence at a time), and what the caller heard of it when they cut in.
- :mod:`.agent`: one visit of a script's ``bot`` node: the conversation, barge-in and
  preemption, ``end`` back to the script.
"""
