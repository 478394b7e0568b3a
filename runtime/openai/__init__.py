"""Serving Kiln engines over the OpenAI API: `serve-engine --engine DIR [--host --port]`.

One shared `Session` serves every request, batched in flight. The endpoints:

  POST /v1/completions        prompt: a text, a list of texts, a list of token ids or a list of
                              such lists (choices numbered prompt by prompt: prompt * n + sample)
  POST /v1/chat/completions   messages, rendered with the engine's chat template as transformers'
                              apply_chat_template renders them (runtime/chat_template.py)
  GET /v1/models, GET /health (503 while the engine loads), GET /metrics (Prometheus; the names
  and meanings are in runtime/metrics.py)

Both generation endpoints take `stream` (server-sent events ending with `data: [DONE]`),
`stream_options.include_usage`, `n`, `max_tokens` (chat: also `max_completion_tokens`; by default
16 for completions, and for a chat as many as the engine's max_seq_len leaves room for),
`temperature`, `top_p`, `presence_penalty`, `frequency_penalty`, `seed`, `stop`, and vLLM's
extensions `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`.
Logprobs: completions take `logprobs` (0..20 alternatives per token); chat takes `logprobs: true`
and `top_logprobs` (0..20). Every response that does not stream carries `usage`; `finish_reason`
is `stop` (an end token or a stop string) or `length`.

Errors come in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 naming the
bad parameter (an unknown one included), 404 for a model this server does not serve, 503 while
the engine loads, 500 when it failed to load. A client that disconnects cancels its requests,
which frees their KV blocks at once.
"""
