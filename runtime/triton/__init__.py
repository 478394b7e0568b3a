"""Serving Kiln engines through Triton Inference Server.

`triton-repo --engine DIR --output REPO` writes a model repository; `serve-triton --engine DIR`
starts the real `tritonserver` on 127.0.0.1 with it.

The repository holds one decoupled Python-backend model (default name `kiln`) that serves two
interfaces, so both share one `Session`: one copy of the weights, one KV pool, one in-flight
batch. `max_batch_size` is the engine's, so every tensor has a leading batch dim, as with
TensorRT-LLM's models; each request carries one sequence (batch dim 1).

Token interface, TensorRT-LLM's names and types:
  input_ids INT32 [1, N]           the prompt; input_lengths INT32 [1, 1] may cut off padding
  request_output_len INT32 [1, 1]  most tokens to generate (required)
  end_id INT32                     stop at this token instead of the tokenizer's eos (the eos
                                   is then generated like any other token); -1, as in
                                   TensorRT-LLM's tools, means no end token: generation runs to
                                   the output length (or a stop word)
  pad_id INT32                     accepted; outputs hold one sequence, so nothing is padded
  temperature, runtime_top_p, repetition_penalty, presence_penalty, frequency_penalty FP32
  runtime_top_k, min_length INT32; random_seed UINT64
                                   as in TensorRT-LLM, neither top-k nor top-p set (or both 0)
                                   samples greedily, and top_p 0 alone means no top-p
  streaming BOOL                   a response per new token(s); else one final response
  stop_words_list, bad_words_list INT32 [1, 2, K]
                                   row 0 the words' ids one after another, row 1 each word's
                                   exclusive end offset, padded with -1. One-token stop words
                                   stop in the Session; longer ones are matched here on the
                                   output ids, and the output ends with the stop word.
  return_log_probs BOOL            adds cum_log_probs FP32 [1, 1] (all tokens so far) and
                                   output_log_probs FP32 [1, 1, T] (this response's tokens)
  exclude_input_in_output BOOL     false (default): a non-streaming output_ids starts with the
                                   prompt; streaming responses never repeat it
  -> output_ids INT32 [1, 1, T] and sequence_length INT32 [1, 1] (= T)
Output ids include the token that stopped generation (eos, end_id or a stop word).

Text interface, the names of TensorRT-LLM's ensemble:
  text_input STRING, max_tokens INT32 (required), temperature, top_k, top_p, stream,
  stop_words / bad_words STRING (one comma-separated string, CSV quoting allowed, or several
  strings), plus the shared end_id, pad_id, penalties, min_length, random_seed,
  return_log_probs -> text_output STRING: the generated text only (streamed as pieces).
  Stop words stop on the text (left out of it); bad words are tokenized without special
  tokens and banned as token sequences.

A request with the other interface's inputs, or whose values the Session refuses, gets an
INVALID_ARG error; the model keeps serving. A request whose client goes away (a stopped gRPC
stream, a closed HTTP connection) is cancelled in the Session within 0.1 s, freeing its KV
blocks. On Triton's metrics endpoint: the gauges kiln_kv_cache_blocks{state="used"|"total"|
"peak"} and kiln_requests{state="running"|"waiting"}, and the counter
kiln_requests_finished_total{reason="stop"|"length"|"cancelled"|"error"}; each request's
count and gauges are updated before its final response is sent.
"""
