/*
 * pagedrun_client.h: the C client library of the paged-run server (libpagedrun_client).
 *
 * It speaks the wire protocol of docs/protocol.md (version 1, any 1.x revision) over one ZeroMQ
 * DEALER socket: GENERATE with streamed or whole replies (chat options, LoRA adapters), ABORT,
 * LOAD_LORA / UNLOAD_LORA, PING heartbeats that follow the server's lease, liveness checks (a
 * dead, hung or restarted server is reported as PAGEDRUN_E_SERVER_UNAVAILABLE within a bound,
 * not after the full timeout), CURVE.
 *
 * Server loss: every waiting request fails with PAGEDRUN_E_SERVER_UNAVAILABLE when the
 * connection drops (ZeroMQ socket monitor: the server process exited or restarted), when a PING
 * goes unanswered for ping_timeout_s (the server hangs or is unreachable), or when a reply
 * carries a new server_id (a restarted server: the requests the old one answered, or that were
 * sent before it last spoke, are lost; one sent later goes on). Requests are not retried (they
 * may or may not have run); the socket reconnects by itself, so the next call works once a
 * server is back (or call pagedrun_reconnect for a fresh socket).
 *
 * C99. Opaque handles, no global state. Thread-compatible: a client may be used by one thread at
 * a time (use one client per thread); different clients are independent. Callbacks run in the
 * thread that called into the library, from inside pagedrun_poll / pagedrun_wait /
 * pagedrun_stream(_ext) / pagedrun_generate(_ext) / pagedrun_abort / pagedrun_ping /
 * pagedrun_load_lora / pagedrun_unload_lora / pagedrun_connect. From a callback only
 * pagedrun_submit(_ext), pagedrun_abort (found = NULL) and the accessors may be called; the
 * waiting calls return PAGEDRUN_E_INVALID_ARGUMENT there, and pagedrun_client_free must not be
 * called there.
 *
 * Every function that can fail returns a pagedrun_status (0 = PAGEDRUN_OK); the client keeps a
 * message for the latest failure (pagedrun_last_error). Strings are UTF-8, NUL-terminated.
 *
 * ABI: library 1.x only adds (functions, and fields at the end of the structs the library
 * fills and hands to callbacks: pagedrun_logprob, pagedrun_server_info); structs the caller
 * allocates keep their layout. 1.1 (protocol 1.3): pagedrun_logprob gained rank, decoded_token
 * and top_decoded_tokens; pagedrun_cumulative_logprob. New sampling fields (logit_bias,
 * bad_words, allowed_token_ids, ...) go through pagedrun_sampling.extra_msgpack.
 * 1.2 (protocol 1.4): request fields beyond pagedrun_request (lora_name, the 1.3 chat options)
 * live in a separate caller-allocated pagedrun_request_ext that starts with its own size
 * (struct_size, set by pagedrun_request_ext_init), taken by pagedrun_submit_ext /
 * pagedrun_stream_ext / pagedrun_generate_ext: the library reads only the fields within
 * struct_size, so a program built against this header keeps working with later 1.x libraries,
 * and later versions grow that struct instead of adding pagedrun_*_ext2 functions.
 * pagedrun_load_lora / pagedrun_unload_lora (LOAD_LORA / UNLOAD_LORA); pagedrun_server_info
 * gained enable_lora.
 */
#ifndef PAGEDRUN_CLIENT_H
#define PAGEDRUN_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(PAGEDRUN_CLIENT_SHARED_BUILD)
#define PAGEDRUN_API __declspec(dllexport)
#elif defined(__GNUC__)
#define PAGEDRUN_API __attribute__((visibility("default")))
#else
#define PAGEDRUN_API
#endif

#define PAGEDRUN_CLIENT_VERSION_MAJOR 1
#define PAGEDRUN_CLIENT_VERSION_MINOR 2
#define PAGEDRUN_CLIENT_VERSION_PATCH 0
/* The wire protocol version byte this library speaks, and the newest revision it knows. */
#define PAGEDRUN_PROTOCOL_VERSION 1
#define PAGEDRUN_PROTOCOL_REVISION "1.4"
/* Request ids are 1..128 characters (docs/protocol.md); buffers of this size hold one + NUL. */
#define PAGEDRUN_REQUEST_ID_MAX 128
#define PAGEDRUN_REQUEST_ID_BUF (PAGEDRUN_REQUEST_ID_MAX + 1)

/* ---- status codes ------------------------------------------------------------------------ */
typedef enum pagedrun_status {
    PAGEDRUN_OK = 0,
    /* The server's ERROR codes (docs/protocol.md, "ERROR"), one each. */
    PAGEDRUN_E_INVALID_MESSAGE = 1,
    PAGEDRUN_E_UNSUPPORTED_VERSION = 2,
    PAGEDRUN_E_UNKNOWN_TYPE = 3,
    PAGEDRUN_E_MESSAGE_TOO_LARGE = 4,
    PAGEDRUN_E_INVALID_REQUEST = 5,
    PAGEDRUN_E_EMPTY_PROMPT = 6,
    PAGEDRUN_E_PROMPT_TOO_LONG = 7,
    PAGEDRUN_E_DUPLICATE_REQUEST_ID = 8,
    PAGEDRUN_E_CAPACITY = 9,
    PAGEDRUN_E_OVERLOADED = 10,
    PAGEDRUN_E_SHUTTING_DOWN = 11,
    PAGEDRUN_E_LEASE_EXPIRED = 12,
    PAGEDRUN_E_INTERNAL_ERROR = 13,
    /* An ERROR reply whose code this library does not know (a later protocol revision). */
    PAGEDRUN_E_SERVER_ERROR = 14,
    /* Client-side conditions. */
    PAGEDRUN_E_TIMEOUT = 100,            /* no reply within the call's timeout (request aborted) */
    PAGEDRUN_E_SERVER_UNAVAILABLE = 101, /* server dead, hung, restarted or never reached */
    PAGEDRUN_E_MALFORMED_REPLY = 102,    /* a reply that breaks the protocol (frames, types) */
    PAGEDRUN_E_CONNECTION = 103,         /* socket / endpoint / CURVE handshake failure */
    PAGEDRUN_E_INVALID_ARGUMENT = 104,   /* bad arguments, or a call not allowed here */
    PAGEDRUN_E_NO_MEMORY = 105,
    PAGEDRUN_E_NOT_FOUND = 106           /* no request in flight with that id */
} pagedrun_status;

/* A static description of a status ("capacity: the request can never fit the KV cache"). */
PAGEDRUN_API const char *pagedrun_strerror(int status);
/* The wire code of a server error status ("capacity"), the client-side name of the others
 * ("timeout", "server_unavailable", "malformed_reply", "connection", ...); "ok" for 0. */
PAGEDRUN_API const char *pagedrun_status_name(int status);
/* The status of a wire error code ("overloaded" -> PAGEDRUN_E_OVERLOADED); unknown codes give
 * PAGEDRUN_E_SERVER_ERROR. */
PAGEDRUN_API int pagedrun_status_from_code(const char *code);

/* ---- client ------------------------------------------------------------------------------ */
typedef struct pagedrun_client pagedrun_client;

typedef struct pagedrun_options {
    /* Default per-call timeout in seconds: how long a call waits for the next reply frame of
     * its request (60). A request may override it. */
    double timeout_s;
    /* pagedrun_connect asks the server for MODEL_INFO (learns lease_s, limits, server_id)
     * and waits up to this long for it (10; a server still starting up may take a while);
     * <= 0: connect does not wait for the server at all. */
    double connect_timeout_s;
    /* Liveness (docs/protocol.md, "Liveness", revision 1.2). While anything waits for a reply
     * the client sends a PING at least every min(heartbeat_s, lease_s / 3), lease_s being what
     * the server announces (MODEL_INFO_REPLY at connect, every PONG), and also after
     * max(2 s, that interval) without any frame from the server; not knowing the lease yet, it
     * PINGs as soon as it starts waiting. heartbeat_s: 5 by default (<= 0: 5). */
    double heartbeat_s;
    /* No frame at all within this many seconds of a PING: the server is dead, hung or
     * unreachable, and every waiting request fails with PAGEDRUN_E_SERVER_UNAVAILABLE (instead
     * of waiting out its timeout). 4 by default (<= 0: 4). */
    double ping_timeout_s;
    /* CURVE (all three NULL: off). Keys are 40-character Z85 strings. With a server key and no
     * client pair, an ephemeral client pair is made. */
    const char *server_public_key;
    const char *client_public_key;
    const char *client_secret_key;
    /* How long closing the socket may take to flush queued frames (an ABORT), ms (200). */
    int linger_ms;
} pagedrun_options;

/* Defaults for every field. Always start from it: later versions may add fields. */
PAGEDRUN_API void pagedrun_options_init(pagedrun_options *opts);

/* A new, unconnected client; opts may be NULL (defaults). NULL only when out of memory. */
PAGEDRUN_API pagedrun_client *pagedrun_client_new(const pagedrun_options *opts);
/* Connects to "tcp://host:port" or "ipc:///path" and (connect_timeout_s > 0) waits for the
 * server's MODEL_INFO_REPLY. PAGEDRUN_E_SERVER_UNAVAILABLE when the server does not answer in
 * time (the socket stays connected and keeps retrying; calls may still succeed later). */
PAGEDRUN_API int pagedrun_connect(pagedrun_client *client, const char *endpoint);
/* Closes the connection; requests in flight are aborted (best effort) and end with
 * PAGEDRUN_E_CONNECTION through their on_error. The client may connect again. */
PAGEDRUN_API int pagedrun_disconnect(pagedrun_client *client);
/* A fresh socket to the same endpoint (disconnect + connect). */
PAGEDRUN_API int pagedrun_reconnect(pagedrun_client *client);
/* Disconnects if needed and frees everything. NULL is fine. */
PAGEDRUN_API void pagedrun_client_free(pagedrun_client *client);
/* The message of the latest failure on this client ("" if none). Valid until the next call. */
PAGEDRUN_API const char *pagedrun_last_error(const pagedrun_client *client);

/* What the server told us about itself (MODEL_INFO_REPLY at connect; PONGs update lease_s and
 * status, every reply server_id). Strings are "" and numbers -1 when unknown. */
typedef struct pagedrun_server_info {
    char model[256];
    int64_t max_model_len;
    int64_t vocab_size;
    int64_t max_message_bytes;
    char protocol_revision[16];
    double lease_s;
    char server_id[PAGEDRUN_REQUEST_ID_BUF]; /* 1.2: random per server start ("" before 1.2) */
    char status[16];                           /* "ok" / "draining" from the latest PONG */
    /* Library 1.2, protocol 1.4: MODEL_INFO_REPLY enable_lora (1 / 0), -1 when not sent. */
    int enable_lora;
} pagedrun_server_info;

/* The client's view of the server; never NULL. */
PAGEDRUN_API const pagedrun_server_info *pagedrun_get_server_info(const pagedrun_client *client);

typedef struct pagedrun_pong {
    char status[16];
    double lease_s;
    double server_time;
    int64_t num_requests_in_flight;
    char protocol_revision[16];
    char server_id[PAGEDRUN_REQUEST_ID_BUF];
    double round_trip_s; /* measured by the client */
} pagedrun_pong;

/* One PING / PONG; out may be NULL. timeout_s <= 0: the client's timeout_s. */
PAGEDRUN_API int pagedrun_ping(pagedrun_client *client, double timeout_s, pagedrun_pong *out);

/* ---- requests ---------------------------------------------------------------------------- */
/* "Unset" values for pagedrun_sampling: the server's default applies (the field is not sent). */
#define PAGEDRUN_UNSET_INT INT64_MIN
#define PAGEDRUN_UNSET_FLOAT (-1.0e308)
/* max_tokens = PAGEDRUN_MAX_TOKENS_NONE sends nil: up to max_model_len. */
#define PAGEDRUN_MAX_TOKENS_NONE (-1)

/* Sampling parameters (docs/protocol.md, "sampling_params"; vLLM's names). Only fields that are
 * set are sent; the server checks ranges (PAGEDRUN_E_INVALID_REQUEST). */
typedef struct pagedrun_sampling {
    double temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    int64_t top_k, seed, max_tokens, min_tokens, n, logprobs, prompt_logprobs;
    /* booleans: -1 unset, 0 false, 1 true */
    int ignore_eos, include_stop_str_in_output, skip_special_tokens;
    const char *const *stop; /* n_stop stop strings */
    size_t n_stop;
    const int32_t *stop_token_ids;
    size_t n_stop_token_ids;
    /* Further entries as a pre-encoded msgpack map (its keys must not repeat a field set
     * above); checked to be exactly one map. NULL: none. */
    const void *extra_msgpack;
    size_t extra_msgpack_len;
} pagedrun_sampling;

/* Every field unset. */
PAGEDRUN_API void pagedrun_sampling_init(pagedrun_sampling *sampling);

typedef struct pagedrun_chat_message {
    const char *role; /* "system", "user", "assistant", "tool" */
    const char *content;
} pagedrun_chat_message;

typedef struct pagedrun_request {
    /* NULL: the library makes one (returned by pagedrun_submit). */
    const char *request_id;
    /* Exactly one of: prompt; prompt_token_ids (n_prompt_token_ids > 0); messages. */
    const char *prompt;
    const int32_t *prompt_token_ids;
    size_t n_prompt_token_ids;
    const pagedrun_chat_message *messages;
    size_t n_messages;
    const pagedrun_sampling *sampling; /* NULL: server defaults */
    /* Longest wait for the next reply frame, seconds; 0: the client's timeout_s. */
    double timeout_s;
    /* Longest time for the whole request, seconds; 0: none. */
    double deadline_s;
} pagedrun_request;

/* Every field zero / NULL. */
PAGEDRUN_API void pagedrun_request_init(pagedrun_request *req);

/* Library 1.2 (protocol 1.4): the GENERATE fields that pagedrun_request has no room for. The
 * caller allocates it, initializes it with pagedrun_request_ext_init (which sets struct_size
 * to the size this header knows), sets what it needs, and passes it to the *_ext functions.
 * The library reads only the fields that lie within struct_size (a field beyond it is unset);
 * bytes past the end of the struct the library knows must be zero (fields added later have 0
 * as their unset value), else PAGEDRUN_E_INVALID_ARGUMENT. Unset fields are not sent (send
 * them only to servers of protocol 1.3 / 1.4 and later: older servers refuse unknown fields).
 * Client-side checks give PAGEDRUN_E_INVALID_ARGUMENT; the server checks the rest
 * (PAGEDRUN_E_INVALID_REQUEST with its message). */
typedef struct pagedrun_request_ext {
    size_t struct_size;
    /* Protocol 1.4: run under this loaded LoRA adapter (1..128 characters); NULL: the base
     * model. An unknown name (or LoRA off on the server) is PAGEDRUN_E_INVALID_REQUEST whose
     * message names the loaded adapters. */
    const char *lora_name;
    /* Protocol 1.3 chat options, with pagedrun_request.messages only (else
     * PAGEDRUN_E_INVALID_ARGUMENT). chat_template: a Jinja template used instead of the
     * model's (at most 32768 characters); NULL: the model's. */
    const char *chat_template;
    /* -1 unset (the server's default: add_generation_prompt true, continue_final_message
     * false), 0 false, 1 true. continue_final_message 1 needs add_generation_prompt 0 (the
     * server refuses the pair otherwise). */
    int add_generation_prompt, continue_final_message;
    /* The template's `tools`: one pre-encoded msgpack array of at most 128 maps; NULL: none. */
    const void *tools_msgpack;
    size_t tools_msgpack_len;
    /* More template variables: one pre-encoded msgpack map of at most 64 entries with string
     * keys (not messages, add_generation_prompt, continue_final_message, tools, tokenize,
     * chat_template); NULL: none. */
    const void *chat_template_kwargs_msgpack;
    size_t chat_template_kwargs_msgpack_len;
} pagedrun_request_ext;

/* Every field unset; struct_size = sizeof(pagedrun_request_ext). */
PAGEDRUN_API void pagedrun_request_ext_init(pagedrun_request_ext *ext);

typedef struct pagedrun_usage {
    int64_t prompt_tokens, cached_prompt_tokens, completion_tokens; /* -1 if absent */
    /* FINAL `metrics`, seconds; -1 if nil/absent */
    double time_to_first_token_s, time_per_output_token_s, e2e_latency_s;
    /* FINAL `stop_reason`: the stop string (else NULL) or the stop token id (else -1). */
    const char *stop_reason;
    int64_t stop_token_id;
} pagedrun_usage;

/* One logprobs entry (DELTA `logprobs`, `prompt_logprobs`); token_id -1 is a nil entry
 * (prompt token 0). token_id is the sampled (or prompt) token; top_*: the n_top most likely
 * tokens at that position, best first, so top entry i has rank i + 1 (the sampled token is
 * among them only when its rank is within n_top). Valid during the on_logprobs call only. */
typedef struct pagedrun_logprob {
    int32_t token_id;
    double logprob;
    const int32_t *top_ids;
    const double *top_logprobs;
    size_t n_top;
    /* Library 1.1, protocol 1.3 (vLLM's Logprob). rank: 1 + the number of tokens more likely
     * than token_id, -1 when the server did not send it (before 1.3). decoded_token: the
     * token's text alone (cut at a NUL byte, should the token hold one), NULL when not sent.
     * top_decoded_tokens: the same for each top entry (n_top of them; each NULL when not
     * sent). */
    int64_t rank;
    const char *decoded_token;
    const char *const *top_decoded_tokens;
} pagedrun_logprob;

/* Streaming callbacks; any may be NULL. Pointers are valid during the call only.
 *  on_delta: new text (text_len bytes, also NUL-terminated) and token ids of one DELTA (or of
 *    the whole completion for pagedrun_generate's FINAL). Return nonzero to abort the request
 *    (its stream then ends with on_final("abort")). With n > 1 (via `n`) deltas of every
 *    sequence come here; pagedrun_delta_index tells which.
 *  on_final: the FINAL (finish_reason of sequence 0: "stop", "length", "abort").
 *  on_error: the request ended without a FINAL: an ERROR reply or a client-side failure.
 *  on_logprobs: `logprobs` of a DELTA (is_prompt 0) or the `prompt_logprobs` (is_prompt 1; sent
 *    once per request, on a DELTA or the FINAL).
 * Exactly one of on_final / on_error is called per submitted request. */
typedef struct pagedrun_callbacks {
    int (*on_delta)(const char *text, size_t text_len, const int32_t *token_ids,
                    size_t n_tokens, void *user);
    void (*on_final)(const char *finish_reason, const pagedrun_usage *usage, void *user);
    void (*on_error)(int status, const char *message, void *user);
    void (*on_logprobs)(const pagedrun_logprob *entries, size_t n_entries, int is_prompt,
                        void *user);
} pagedrun_callbacks;

/* Sends a streamed GENERATE (stream: true) and returns at once; replies are dispatched to the
 * callbacks by pagedrun_poll / pagedrun_wait (or any other call that waits). id_out (may be
 * NULL; PAGEDRUN_REQUEST_ID_BUF bytes) receives the request id. Any number of requests may be in
 * flight on one client. */
PAGEDRUN_API int pagedrun_submit(pagedrun_client *client, const pagedrun_request *req,
                                 const pagedrun_callbacks *callbacks, void *user,
                                 char *id_out);
/* Waits up to timeout_ms (0: just look, < 0: until something happens) for replies, dispatches
 * them, sends heartbeats, enforces timeouts and liveness. Returns the number of requests still
 * in flight (>= 0), or a negative -status on a socket failure. */
PAGEDRUN_API int pagedrun_poll(pagedrun_client *client, int timeout_ms);
/* Runs pagedrun_poll until the request ends; returns its outcome: PAGEDRUN_OK after its FINAL
 * (whatever the finish_reason), else the status its on_error got. PAGEDRUN_E_NOT_FOUND if it is
 * not in flight. Not callable from a callback. */
PAGEDRUN_API int pagedrun_wait(pagedrun_client *client, const char *request_id);
/* pagedrun_submit + pagedrun_wait. */
PAGEDRUN_API int pagedrun_stream(pagedrun_client *client, const pagedrun_request *req,
                                 const pagedrun_callbacks *callbacks, void *user);
/* Library 1.2: pagedrun_submit / pagedrun_stream with the fields of ext (may be NULL: then
 * exactly pagedrun_submit / pagedrun_stream). */
PAGEDRUN_API int pagedrun_submit_ext(pagedrun_client *client, const pagedrun_request *req,
                                     const pagedrun_request_ext *ext,
                                     const pagedrun_callbacks *callbacks, void *user,
                                     char *id_out);
PAGEDRUN_API int pagedrun_stream_ext(pagedrun_client *client, const pagedrun_request *req,
                                     const pagedrun_request_ext *ext,
                                     const pagedrun_callbacks *callbacks, void *user);
/* The sequence index of the DELTA being delivered (valid inside on_delta). */
PAGEDRUN_API uint32_t pagedrun_delta_index(const pagedrun_client *client);
/* Library 1.1, protocol 1.3: the `cumulative_logprob` (sum of the sampled tokens' logprobs so
 * far; sent when the request set sampling.logprobs) of the reply being delivered: inside
 * on_delta / on_logprobs the DELTA's (of its sequence, pagedrun_delta_index), inside on_final
 * the FINAL's sequence 0; after pagedrun_generate returns, its completion's. Returns 1 and
 * stores it in *out (may be NULL) when that reply carried one, else 0. */
PAGEDRUN_API int pagedrun_cumulative_logprob(const pagedrun_client *client, double *out);

/* Sends ABORT for a request of this client. found (may be NULL): waits for ABORTED and stores 1
 * if the server still had it in flight (its stream ends with on_final("abort")), 0 if not.
 * From inside a callback found must be NULL (the ABORT is sent, not waited for). */
PAGEDRUN_API int pagedrun_abort(pagedrun_client *client, const char *request_id, int *found);

/* The whole completion of a blocking generation. */
typedef struct pagedrun_completion {
    char request_id[PAGEDRUN_REQUEST_ID_BUF];
    char *text; /* NUL-terminated, text_len bytes (malloc'ed) */
    size_t text_len;
    int32_t *token_ids; /* n_tokens (malloc'ed) */
    size_t n_tokens;
    char finish_reason[16];
    pagedrun_usage usage; /* usage.stop_reason points into stop_reason_buf */
    char stop_reason_buf[256];
    char error_message[512]; /* when the call failed */
} pagedrun_completion;

/* Blocking generation (stream: false on the wire: one FINAL holding everything). Returns
 * PAGEDRUN_OK with *out filled (free with pagedrun_completion_free), or the failure; out is
 * always safe to free. */
PAGEDRUN_API int pagedrun_generate(pagedrun_client *client, const pagedrun_request *req,
                                   pagedrun_completion *out);
/* Library 1.2: pagedrun_generate with the fields of ext (may be NULL). */
PAGEDRUN_API int pagedrun_generate_ext(pagedrun_client *client, const pagedrun_request *req,
                                       const pagedrun_request_ext *ext,
                                       pagedrun_completion *out);
PAGEDRUN_API void pagedrun_completion_free(pagedrun_completion *completion);

/* ---- LoRA adapters (library 1.2, protocol 1.4) ------------------------------------------- */
/* LOAD_LORA: loads the PEFT adapter directory lora_path (a path on the server's file system,
 * 1..4096 characters) under lora_name (1..128 characters) and waits (up to the client's
 * timeout_s, with heartbeats and liveness as for requests) for the LORA_REPLY.
 * lora_int_id_out (may be NULL) receives the adapter's id. Loading a name again from the same
 * path is fine (the same id). The server refuses with PAGEDRUN_E_INVALID_REQUEST (its message
 * in pagedrun_last_error): LoRA off (serve --enable-lora), a bad directory, a name loaded from
 * another path. Not callable from a callback. */
PAGEDRUN_API int pagedrun_load_lora(pagedrun_client *client, const char *lora_name,
                                    const char *lora_path, int64_t *lora_int_id_out);
/* UNLOAD_LORA: unloads the adapter lora_name and waits for the LORA_REPLY; unloaded_out (may
 * be NULL) receives 1 when the reply says it is no longer loaded. PAGEDRUN_E_INVALID_REQUEST:
 * an unknown name, LoRA off, or the adapter is in use by a running or waiting request. */
PAGEDRUN_API int pagedrun_unload_lora(pagedrun_client *client, const char *lora_name,
                                      int *unloaded_out);

/* The number of requests in flight on this client. */
PAGEDRUN_API size_t pagedrun_in_flight(const pagedrun_client *client);

#ifdef __cplusplus
}
#endif
#endif /* PAGEDRUN_CLIENT_H */
