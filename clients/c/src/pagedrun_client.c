/*
 * libpagedrun_client: the C client library of the paged-run server (see pagedrun_client.h and
 * docs/protocol.md). One DEALER socket per client, a monitor socket that reports connection
 * loss and CURVE handshake failures, msgpack-c for bodies.
 *
 * Structure: requests in flight live in a small table (c->reqs); every waiting call runs
 * pump(), which polls the socket and the monitor, dispatches whole messages to the requests'
 * callbacks, and runs the timers (heartbeat PINGs, liveness, per-request timeouts). Callbacks may
 * call pagedrun_abort (without waiting) and pagedrun_submit; the table is looked up again after
 * every callback, so a callback that ends requests is safe. A top-level call that waits for one
 * reply of its own (PING, MODEL_INFO at connect, ABORT with found, LOAD_LORA / UNLOAD_LORA) sets
 * up c->rpc and pumps like any other wait. GENERATE fields beyond pagedrun_request come from a
 * pagedrun_request_ext, read only as far as its struct_size (read_ext).
 */
#define _POSIX_C_SOURCE 200809L
#include "pagedrun_client.h"

#include <errno.h>
#include <msgpack.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

enum {
    MSG_GENERATE = 0x01, MSG_ABORT = 0x02, MSG_PING = 0x03, MSG_MODEL_INFO = 0x04,
    MSG_LOAD_LORA = 0x06, MSG_UNLOAD_LORA = 0x07, /* 1.4 */
    MSG_DELTA = 0x81, MSG_FINAL = 0x82, MSG_ABORTED = 0x83, MSG_PONG = 0x84,
    MSG_MODEL_INFO_REPLY = 0x85, MSG_STATS_REPLY = 0x86, MSG_LORA_REPLY = 0x87, MSG_ERROR = 0xFF
};

#define NS_PER_S 1000000000LL
#define DEFAULT_TIMEOUT_S 60.0
#define DEFAULT_CONNECT_TIMEOUT_S 10.0
/* Liveness, as docs/protocol.md "Liveness" (1.2) and the Python clients: PING at least every
 * min(heartbeat_s, lease_s * LEASE_FRACTION), and after max(MIN_SILENCE_S, that) of silence. */
#define DEFAULT_HEARTBEAT_S 5.0
#define LEASE_FRACTION (1.0 / 3.0)
#define MIN_SILENCE_S 2.0
#define DEFAULT_PING_TIMEOUT_S 4.0
#define MIN_INTERVAL_NS 10000000LL /* 10 ms: floor of heartbeat / ping timeout */
#define MAX_MESSAGES_PER_PUMP 1024
#define MAX_FRAMES_KEPT 3
/* Request field limits of docs/protocol.md (GENERATE, LOAD_LORA), in characters (code points). */
#define MAX_LORA_NAME_CHARS 128
#define MAX_LORA_PATH_CHARS 4096
#define MAX_CHAT_TEMPLATE_CHARS 32768
#define MAX_TOOLS 128
#define MAX_CHAT_TEMPLATE_KWARGS 64

/* ---- status names ------------------------------------------------------------------------ */
typedef struct { int status; const char *name; const char *text; } status_entry;

static const status_entry STATUS_TABLE[] = {
    {PAGEDRUN_OK, "ok", "success"},
    {PAGEDRUN_E_INVALID_MESSAGE, "invalid_message",
     "the server could not read a message (frames or msgpack)"},
    {PAGEDRUN_E_UNSUPPORTED_VERSION, "unsupported_version",
     "the server does not speak this protocol version"},
    {PAGEDRUN_E_UNKNOWN_TYPE, "unknown_type", "the server does not know the message type"},
    {PAGEDRUN_E_MESSAGE_TOO_LARGE, "message_too_large",
     "the request body is over the server's max_message_bytes"},
    {PAGEDRUN_E_INVALID_REQUEST, "invalid_request",
     "a request field has a wrong type or range, or is unknown"},
    {PAGEDRUN_E_EMPTY_PROMPT, "empty_prompt", "the prompt is empty"},
    {PAGEDRUN_E_PROMPT_TOO_LONG, "prompt_too_long", "the prompt is over max_model_len tokens"},
    {PAGEDRUN_E_DUPLICATE_REQUEST_ID, "duplicate_request_id",
     "the request id is already in flight on this connection"},
    {PAGEDRUN_E_CAPACITY, "capacity", "the request can never fit the KV cache"},
    {PAGEDRUN_E_OVERLOADED, "overloaded", "too many requests in flight; retry later"},
    {PAGEDRUN_E_SHUTTING_DOWN, "shutting_down", "the server is shutting down"},
    {PAGEDRUN_E_LEASE_EXPIRED, "lease_expired",
     "the connection was silent for the server's lease; its requests were aborted"},
    {PAGEDRUN_E_INTERNAL_ERROR, "internal_error", "the engine failed; the request was aborted"},
    {PAGEDRUN_E_SERVER_ERROR, "server_error", "the server sent an error code this client does "
                                              "not know"},
    {PAGEDRUN_E_TIMEOUT, "timeout", "no reply within the timeout; the request was aborted"},
    {PAGEDRUN_E_SERVER_UNAVAILABLE, "server_unavailable",
     "the server is unreachable, stopped answering, or restarted"},
    {PAGEDRUN_E_MALFORMED_REPLY, "malformed_reply", "the server sent a reply that breaks the "
                                                    "protocol"},
    {PAGEDRUN_E_CONNECTION, "connection",
     "connection failure (endpoint, socket, CURVE handshake, or disconnected by the client)"},
    {PAGEDRUN_E_INVALID_ARGUMENT, "invalid_argument", "invalid argument or call"},
    {PAGEDRUN_E_NO_MEMORY, "no_memory", "out of memory"},
    {PAGEDRUN_E_NOT_FOUND, "not_found", "no such request in flight"},
};
#define STATUS_COUNT (sizeof STATUS_TABLE / sizeof STATUS_TABLE[0])

static const status_entry *status_entry_of(int status) {
    for (size_t i = 0; i < STATUS_COUNT; i++)
        if (STATUS_TABLE[i].status == status) return &STATUS_TABLE[i];
    return NULL;
}

const char *pagedrun_strerror(int status) {
    const status_entry *e = status_entry_of(status);
    return e ? e->text : "unknown status";
}

const char *pagedrun_status_name(int status) {
    const status_entry *e = status_entry_of(status);
    return e ? e->name : "unknown";
}

int pagedrun_status_from_code(const char *code) {
    if (code)
        for (size_t i = 0; i < STATUS_COUNT; i++)
            if (STATUS_TABLE[i].status >= PAGEDRUN_E_INVALID_MESSAGE &&
                STATUS_TABLE[i].status <= PAGEDRUN_E_INTERNAL_ERROR &&
                strcmp(STATUS_TABLE[i].name, code) == 0)
                return STATUS_TABLE[i].status;
    return PAGEDRUN_E_SERVER_ERROR;
}

/* ---- types ------------------------------------------------------------------------------- */
typedef struct pr_req {
    char id[PAGEDRUN_REQUEST_ID_BUF];
    pagedrun_callbacks cb;
    void *user;
    int stream;
    int64_t timeout_ns, deadline_ns, last_activity_ns, sent_ns;
    /* the server_id of its first reply ("" none yet): when the server_id changes, a request
     * the old instance answered, or sent before the old instance last spoke, is lost */
    char answered_by[PAGEDRUN_REQUEST_ID_BUF];
} pr_req;

/* The one blocking exchange a top-level call may wait for (PING, MODEL_INFO, ABORT,
 * LOAD_LORA / UNLOAD_LORA). */
typedef struct {
    int active, done, status;
    int is_connect; /* the handshake of pagedrun_connect: bounded by connect_timeout_s alone */
    int expect_type;
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    int64_t deadline_ns;
    pagedrun_pong *pong;
    int found;
    int64_t lora_int_id; /* LORA_REPLY (1.4) */
    int lora_loaded;
} pr_rpc;

struct pagedrun_client {
    pagedrun_options opts;
    char keys[3][48];
    void *ctx, *sock, *mon;
    char *endpoint;
    unsigned mon_seq;
    int handshaken;   /* a session with the server is up (ZMTP/CURVE handshake done) */
    char err[512];
    pagedrun_server_info info;
    int64_t last_sent_ns, last_recv_ns, ping_out_ns;
    uint64_t seq;
    pr_req **reqs;
    size_t n_reqs, cap_reqs;
    pr_rpc rpc;
    struct { int active, done, status; char rid[PAGEDRUN_REQUEST_ID_BUF]; } wait;
    int depth;        /* > 0 while a callback runs */
    uint64_t progress; /* bumped whenever a message is handled or something waiting ends */
    uint32_t delta_index;
    /* cumulative_logprob (1.3) of the reply being delivered (has_cum 0: it carried none) */
    int has_cum;
    double cum;
    msgpack_sbuffer sbuf;
    msgpack_zone zone;
    /* scratch for callbacks */
    char *text; size_t text_cap;
    int32_t *ids; size_t ids_cap;
    pagedrun_logprob *lps; size_t lps_cap;
    /* the top entries of every logprobs entry of one reply, back to back (top_cap each) */
    int32_t *top_ids; double *top_lps; const char **top_toks;
    size_t top_cap;
    char *tok_buf; size_t tok_cap; /* decoded tokens (1.3), NUL-terminated, back to back */
    char stop_buf[256];
};

/* ---- small helpers ----------------------------------------------------------------------- */
static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * NS_PER_S + ts.tv_nsec;
}

static int64_t s_to_ns(double s) { return (int64_t)(s * (double)NS_PER_S); }

static int set_err(pagedrun_client *c, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof c->err, fmt, ap);
    va_end(ap);
    return status;
}

static void copy_str(char *dst, size_t cap, const char *src, size_t n) {
    if (cap == 0) return;
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 64;
    while (n < need) n *= 2;
    void *q = realloc(*p, n * elem);
    if (!q) return -1;
    *p = q;
    *cap = n;
    return 0;
}

/* msgpack object helpers */
static const msgpack_object *map_get(const msgpack_object *map, const char *key) {
    if (!map || map->type != MSGPACK_OBJECT_MAP) return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            memcmp(k->via.str.ptr, key, n) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

static int is_nil(const msgpack_object *o) { return !o || o->type == MSGPACK_OBJECT_NIL; }
static int is_str(const msgpack_object *o) { return o && o->type == MSGPACK_OBJECT_STR; }
static int is_int(const msgpack_object *o) {
    return o && (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ||
                 o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER);
}
static int is_num(const msgpack_object *o) {
    return is_int(o) || (o && (o->type == MSGPACK_OBJECT_FLOAT32 ||
                               o->type == MSGPACK_OBJECT_FLOAT64));
}
static int64_t as_i64(const msgpack_object *o) {
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER)
        return o->via.u64 > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)o->via.u64;
    return o->via.i64;
}
static double as_f64(const msgpack_object *o) {
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) return (double)o->via.u64;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) return (double)o->via.i64;
    return o->via.f64;
}
static void obj_str(const msgpack_object *o, char *dst, size_t cap) {
    if (is_str(o)) copy_str(dst, cap, o->via.str.ptr, o->via.str.size);
}

/* Structural check of one msgpack object before msgpack-c builds it: every length and count
 * must fit in the bytes left (each element takes at least one byte), nesting at most
 * MAX_DEPTH, no reserved byte. msgpack-c sizes its allocations from declared counts, so without
 * this a 6-byte reply could ask for gigabytes. 0 ok, -1 not. */
#define MAX_DEPTH 30
static uint64_t rd_be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static int mp_check(const unsigned char *p, size_t n, size_t *off, int depth) {
    if (depth > MAX_DEPTH || *off >= n) return -1;
    unsigned b = p[(*off)++];
    uint64_t len = 0, count = 0;
    int size_bytes = 0, extra = 0, container = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) return 0;
    if ((b & 0xf0) == 0x80) { count = (uint64_t)(b & 0x0f) * 2; container = 1; }
    else if ((b & 0xf0) == 0x90) { count = b & 0x0f; container = 1; }
    else if ((b & 0xe0) == 0xa0) { len = b & 0x1f; }
    else {
        switch (b) {
        case 0xc4: case 0xd9: size_bytes = 1; break;            /* bin8, str8 */
        case 0xc5: case 0xda: size_bytes = 2; break;
        case 0xc6: case 0xdb: size_bytes = 4; break;
        case 0xc7: size_bytes = 1; extra = 1; break;             /* ext8/16/32 + type */
        case 0xc8: size_bytes = 2; extra = 1; break;
        case 0xc9: size_bytes = 4; extra = 1; break;
        case 0xca: len = 4; break;
        case 0xcb: len = 8; break;
        case 0xcc: case 0xd0: len = 1; break;
        case 0xcd: case 0xd1: len = 2; break;
        case 0xce: case 0xd2: len = 4; break;
        case 0xcf: case 0xd3: len = 8; break;
        case 0xd4: len = 2; break;                               /* fixext 1..16 + type */
        case 0xd5: len = 3; break;
        case 0xd6: len = 5; break;
        case 0xd7: len = 9; break;
        case 0xd8: len = 17; break;
        case 0xdc: size_bytes = 2; container = 1; break;         /* array16/32 */
        case 0xdd: size_bytes = 4; container = 1; break;
        case 0xde: size_bytes = 2; container = 2; break;         /* map16/32 */
        case 0xdf: size_bytes = 4; container = 2; break;
        default: return -1;                                      /* 0xc1 */
        }
        if (size_bytes) {
            if ((size_t)size_bytes > n - *off) return -1;
            uint64_t v = rd_be(p + *off, size_bytes);
            *off += (size_t)size_bytes;
            if (container) count = container == 2 ? v * 2 : v;
            else len = v + (uint64_t)extra;
        }
    }
    if (!container) {
        if (len > n - *off) return -1;
        *off += (size_t)len;
        return 0;
    }
    if (count > n - *off) return -1;
    for (uint64_t i = 0; i < count; i++)
        if (mp_check(p, n, off, depth + 1) < 0) return -1;
    return 0;
}

/* packing */
static void pack_cstr(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* ---- options / lifecycle ----------------------------------------------------------------- */
void pagedrun_options_init(pagedrun_options *o) {
    if (!o) return;
    memset(o, 0, sizeof *o);
    o->timeout_s = DEFAULT_TIMEOUT_S;
    o->connect_timeout_s = DEFAULT_CONNECT_TIMEOUT_S;
    o->heartbeat_s = DEFAULT_HEARTBEAT_S;
    o->ping_timeout_s = DEFAULT_PING_TIMEOUT_S;
    o->linger_ms = 200;
}

void pagedrun_sampling_init(pagedrun_sampling *s) {
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->temperature = s->top_p = s->min_p = s->repetition_penalty = s->presence_penalty =
        s->frequency_penalty = PAGEDRUN_UNSET_FLOAT;
    s->top_k = s->seed = s->max_tokens = s->min_tokens = s->n = s->logprobs =
        s->prompt_logprobs = PAGEDRUN_UNSET_INT;
    s->ignore_eos = s->include_stop_str_in_output = s->skip_special_tokens = -1;
}

void pagedrun_request_init(pagedrun_request *r) {
    if (r) memset(r, 0, sizeof *r);
}

void pagedrun_request_ext_init(pagedrun_request_ext *e) {
    if (!e) return;
    memset(e, 0, sizeof *e);
    e->struct_size = sizeof *e;
    e->add_generation_prompt = e->continue_final_message = -1;
}

static void reset_info(pagedrun_server_info *info) {
    memset(info, 0, sizeof *info);
    info->max_model_len = info->vocab_size = info->max_message_bytes = -1;
    info->lease_s = -1;
    info->enable_lora = -1;
}

pagedrun_client *pagedrun_client_new(const pagedrun_options *opts) {
    pagedrun_client *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    if (opts) c->opts = *opts;
    else pagedrun_options_init(&c->opts);
    const char *keys[3] = {c->opts.server_public_key, c->opts.client_public_key,
                           c->opts.client_secret_key};
    for (int i = 0; i < 3; i++) {
        if (keys[i]) copy_str(c->keys[i], sizeof c->keys[i], keys[i], strlen(keys[i]));
    }
    c->opts.server_public_key = keys[0] ? c->keys[0] : NULL;
    c->opts.client_public_key = keys[1] ? c->keys[1] : NULL;
    c->opts.client_secret_key = keys[2] ? c->keys[2] : NULL;
    if (c->opts.timeout_s <= 0) c->opts.timeout_s = DEFAULT_TIMEOUT_S;
    if (c->opts.heartbeat_s <= 0) c->opts.heartbeat_s = DEFAULT_HEARTBEAT_S;
    if (c->opts.ping_timeout_s <= 0) c->opts.ping_timeout_s = DEFAULT_PING_TIMEOUT_S;
    if (c->opts.linger_ms < 0) c->opts.linger_ms = 0;
    reset_info(&c->info);
    msgpack_sbuffer_init(&c->sbuf);
    if (!msgpack_zone_init(&c->zone, 4096)) {
        free(c);
        return NULL;
    }
    c->ctx = zmq_ctx_new();
    if (!c->ctx) {
        msgpack_zone_destroy(&c->zone);
        free(c);
        return NULL;
    }
    return c;
}

const char *pagedrun_last_error(const pagedrun_client *c) { return c ? c->err : ""; }

const pagedrun_server_info *pagedrun_get_server_info(const pagedrun_client *c) {
    return &c->info;
}

size_t pagedrun_in_flight(const pagedrun_client *c) { return c ? c->n_reqs : 0; }

uint32_t pagedrun_delta_index(const pagedrun_client *c) { return c ? c->delta_index : 0; }

int pagedrun_cumulative_logprob(const pagedrun_client *c, double *out) {
    if (!c || !c->has_cum) return 0;
    if (out) *out = c->cum;
    return 1;
}

/* ---- timing policy ----------------------------------------------------------------------- */
/* Longest gap between two messages to the server while something waits. */
static int64_t keepalive_ns(const pagedrun_client *c) {
    double hb = c->opts.heartbeat_s;
    if (c->info.lease_s > 0 && c->info.lease_s * LEASE_FRACTION < hb)
        hb = c->info.lease_s * LEASE_FRACTION;
    int64_t ns = s_to_ns(hb);
    return ns < MIN_INTERVAL_NS ? MIN_INTERVAL_NS : ns;
}

/* Silence from the server after which a waiting client PINGs it. */
static int64_t silence_ns(const pagedrun_client *c) {
    int64_t k = keepalive_ns(c), m = s_to_ns(MIN_SILENCE_S);
    return k > m ? k : m;
}

static int64_t ping_timeout_ns(const pagedrun_client *c) {
    int64_t ns = s_to_ns(c->opts.ping_timeout_s);
    return ns < MIN_INTERVAL_NS ? MIN_INTERVAL_NS : ns;
}

/* ---- request table ----------------------------------------------------------------------- */
static pr_req *find_req(pagedrun_client *c, const char *id, size_t n) {
    for (size_t i = 0; i < c->n_reqs; i++)
        if (strlen(c->reqs[i]->id) == n && memcmp(c->reqs[i]->id, id, n) == 0) return c->reqs[i];
    return NULL;
}

static void remove_req(pagedrun_client *c, pr_req *r) {
    for (size_t i = 0; i < c->n_reqs; i++)
        if (c->reqs[i] == r) {
            c->reqs[i] = c->reqs[--c->n_reqs];
            return;
        }
}

/* The request ended: take it out of the table, record the outcome for pagedrun_wait, then call
 * its final callback (after which r is freed). */
static void end_req_final(pagedrun_client *c, pr_req *r, const char *finish_reason,
                          const pagedrun_usage *usage) {
    remove_req(c, r);
    c->progress++;
    if (c->wait.active && strcmp(c->wait.rid, r->id) == 0) {
        c->wait.done = 1;
        c->wait.status = PAGEDRUN_OK;
    }
    if (r->cb.on_final) {
        c->depth++;
        r->cb.on_final(finish_reason, usage, r->user);
        c->depth--;
    }
    free(r);
}

static void end_req_error(pagedrun_client *c, pr_req *r, int status, const char *message) {
    remove_req(c, r);
    c->progress++;
    if (c->wait.active && strcmp(c->wait.rid, r->id) == 0) {
        c->wait.done = 1;
        c->wait.status = status;
    }
    snprintf(c->err, sizeof c->err, "%s", message);
    if (r->cb.on_error) {
        c->depth++;
        r->cb.on_error(status, message, r->user);
        c->depth--;
    }
    free(r);
}

/* ---- sending ----------------------------------------------------------------------------- */
static int send_frames(pagedrun_client *c, int type) {
    if (!c->sock) return set_err(c, PAGEDRUN_E_CONNECTION, "not connected");
    unsigned char header[2] = {PAGEDRUN_PROTOCOL_VERSION, (unsigned char)type};
    if (zmq_send(c->sock, header, 2, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
        int e = zmq_errno();
        if (e == EAGAIN)
            return set_err(c, PAGEDRUN_E_SERVER_UNAVAILABLE,
                           "cannot send: the queue to the server is full (server not reading)");
        return set_err(c, PAGEDRUN_E_CONNECTION, "send: %s", zmq_strerror(e));
    }
    if (zmq_send(c->sock, c->sbuf.data, c->sbuf.size, ZMQ_DONTWAIT) < 0)
        return set_err(c, PAGEDRUN_E_CONNECTION, "send: %s", zmq_strerror(zmq_errno()));
    c->last_sent_ns = now_ns();
    return PAGEDRUN_OK;
}

/* {request_id: rid} bodies: PING, MODEL_INFO, ABORT. */
static int send_simple(pagedrun_client *c, int type, const char *rid) {
    msgpack_packer pk;
    msgpack_sbuffer_clear(&c->sbuf);
    msgpack_packer_init(&pk, &c->sbuf, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 1);
    pack_cstr(&pk, "request_id");
    pack_cstr(&pk, rid);
    return send_frames(c, type);
}

static int send_ping(pagedrun_client *c) {
    char rid[32];
    snprintf(rid, sizeof rid, "_hb%llu", (unsigned long long)++c->seq);
    int rc = send_simple(c, MSG_PING, rid);
    if (rc == PAGEDRUN_OK && !c->ping_out_ns) c->ping_out_ns = c->last_sent_ns;
    return rc;
}

/* ---- failing many at once ---------------------------------------------------------------- */
static void fail_rpc(pagedrun_client *c, int status) {
    if (c->rpc.active && !c->rpc.done) {
        c->rpc.done = 1;
        c->rpc.status = status;
        c->progress++;
    }
}

/* Ends every request in flight (and the waiting exchange) with `status`; abort_on_server: send
 * each an ABORT (best effort; when the server may still have them). restart_of: only the
 * requests lost when the server with that id restarted (answered by it, or sent no later than
 * old_last_ns, when it last spoke). */
static void fail_all(pagedrun_client *c, int status, int abort_on_server, const char *restart_of,
                     int64_t old_last_ns, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(c->err, sizeof c->err, "%s", msg);
    if (!restart_of) fail_rpc(c, status);
    for (;;) {
        pr_req *victim = NULL;
        for (size_t i = 0; i < c->n_reqs && !victim; i++) {
            pr_req *r = c->reqs[i];
            if (!restart_of || strcmp(r->answered_by, restart_of) == 0 ||
                (!r->answered_by[0] && r->sent_ns <= old_last_ns))
                victim = r;
        }
        if (!victim) break;
        if (abort_on_server) send_simple(c, MSG_ABORT, victim->id);
        end_req_error(c, victim, status, msg);
    }
}

/* ---- parsing replies --------------------------------------------------------------------- */
/* An array of ints (token ids) into c->ids; -1 on a type error. */
static long parse_ids(pagedrun_client *c, const msgpack_object *arr) {
    if (!arr || arr->type != MSGPACK_OBJECT_ARRAY) return -1;
    uint32_t n = arr->via.array.size;
    if (grow((void **)&c->ids, &c->ids_cap, n + 1, sizeof(int32_t)) < 0) return -1;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *o = &arr->via.array.ptr[i];
        if (!is_int(o)) return -1;
        int64_t v = as_i64(o);
        if (v < 0 || v > INT32_MAX) return -1;
        c->ids[i] = (int32_t)v;
    }
    return (long)n;
}

/* A str into c->text, NUL-terminated; -1 on a type error. */
static long parse_text(pagedrun_client *c, const msgpack_object *o) {
    if (!is_str(o)) return -1;
    size_t n = o->via.str.size;
    if (grow((void **)&c->text, &c->text_cap, n + 1, 1) < 0) return -1;
    memcpy(c->text, o->via.str.ptr, n);
    c->text[n] = '\0';
    return (long)n;
}

/* Whether o is absent/nil or a str; adds its size + NUL to *chars. */
static int opt_str(const msgpack_object *o, size_t *chars) {
    if (is_nil(o)) return 1;
    if (!is_str(o)) return 0;
    *chars += o->via.str.size + 1;
    return 1;
}

/* A str into c->tok_buf at *at (NUL-terminated), or NULL for nil / absent. */
static const char *put_tok(pagedrun_client *c, const msgpack_object *o, size_t *at) {
    if (is_nil(o)) return NULL;
    char *dst = c->tok_buf + *at;
    memcpy(dst, o->via.str.ptr, o->via.str.size);
    dst[o->via.str.size] = '\0';
    *at += o->via.str.size + 1;
    return dst;
}

/* Grows every top-entry scratch array to hold n entries. */
static int grow_top(pagedrun_client *c, size_t n) {
    if (n <= c->top_cap) return 0;
    size_t cap = c->top_cap ? c->top_cap : 64;
    while (cap < n) cap *= 2;
    int32_t *ids = realloc(c->top_ids, cap * sizeof *ids);
    if (ids) c->top_ids = ids;
    double *lps = realloc(c->top_lps, cap * sizeof *lps);
    if (lps) c->top_lps = lps;
    const char **toks = realloc((void *)c->top_toks, cap * sizeof *toks);
    if (toks) c->top_toks = toks;
    if (!ids || !lps || !toks) return -1;
    c->top_cap = cap;
    return 0;
}

/* A logprobs array into c->lps; -1 on a type error. Entries are nil (allow_nil: prompt
 * logprobs) or {token_id, logprob, top: [[token_id, logprob], ...]} plus, since 1.3, rank,
 * decoded_token and top_decoded_tokens (one str or nil per top pair); any of these may be nil
 * or absent. Elements of a top pair past the two known (a later revision) are skipped. */
static long parse_logprobs(pagedrun_client *c, const msgpack_object *arr, int allow_nil) {
    if (!arr || arr->type != MSGPACK_OBJECT_ARRAY) return -1;
    uint32_t n = arr->via.array.size;
    size_t total_top = 0, chars = 0;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *e = &arr->via.array.ptr[i];
        if (e->type == MSGPACK_OBJECT_NIL) {
            if (!allow_nil) return -1;
            continue;
        }
        if (e->type != MSGPACK_OBJECT_MAP) return -1;
        const msgpack_object *tid = map_get(e, "token_id"), *lp = map_get(e, "logprob"),
                             *rank = map_get(e, "rank"), *top = map_get(e, "top"),
                             *toks = map_get(e, "top_decoded_tokens");
        if (!is_int(tid) || !is_num(lp) || !(is_nil(rank) || is_int(rank)) ||
            !opt_str(map_get(e, "decoded_token"), &chars))
            return -1;
        uint32_t n_top = 0;
        if (!is_nil(top)) {
            if (top->type != MSGPACK_OBJECT_ARRAY) return -1;
            n_top = top->via.array.size;
            for (uint32_t j = 0; j < n_top; j++) {
                const msgpack_object *pair = &top->via.array.ptr[j];
                if (pair->type != MSGPACK_OBJECT_ARRAY || pair->via.array.size < 2 ||
                    !is_int(&pair->via.array.ptr[0]) || !is_num(&pair->via.array.ptr[1]))
                    return -1;
                int64_t t = as_i64(&pair->via.array.ptr[0]);
                if (t < 0 || t > INT32_MAX) return -1;
            }
        }
        if (!is_nil(toks)) {
            if (toks->type != MSGPACK_OBJECT_ARRAY || toks->via.array.size != n_top) return -1;
            for (uint32_t j = 0; j < n_top; j++)
                if (!opt_str(&toks->via.array.ptr[j], &chars)) return -1;
        }
        total_top += n_top;
    }
    if (grow((void **)&c->lps, &c->lps_cap, n + 1, sizeof(pagedrun_logprob)) < 0 ||
        grow_top(c, total_top + 1) < 0 || grow((void **)&c->tok_buf, &c->tok_cap, chars + 1, 1) < 0)
        return -1;
    size_t k = 0, at = 0;
    for (uint32_t i = 0; i < n; i++) {
        const msgpack_object *e = &arr->via.array.ptr[i];
        pagedrun_logprob *out = &c->lps[i];
        memset(out, 0, sizeof *out);
        out->rank = -1;
        if (e->type == MSGPACK_OBJECT_NIL) {
            out->token_id = -1;
            continue;
        }
        out->token_id = (int32_t)as_i64(map_get(e, "token_id"));
        if (out->token_id < 0) return -1;
        out->logprob = as_f64(map_get(e, "logprob"));
        const msgpack_object *rank = map_get(e, "rank"), *top = map_get(e, "top"),
                             *toks = map_get(e, "top_decoded_tokens");
        if (!is_nil(rank)) out->rank = as_i64(rank);
        out->decoded_token = put_tok(c, map_get(e, "decoded_token"), &at);
        out->top_ids = c->top_ids + k;
        out->top_logprobs = c->top_lps + k;
        out->top_decoded_tokens = c->top_toks + k;
        for (uint32_t j = 0; !is_nil(top) && j < top->via.array.size; j++) {
            const msgpack_object *pair = top->via.array.ptr[j].via.array.ptr;
            c->top_ids[k] = (int32_t)as_i64(&pair[0]);
            c->top_lps[k] = as_f64(&pair[1]);
            c->top_toks[k] = is_nil(toks) ? NULL : put_tok(c, &toks->via.array.ptr[j], &at);
            k++;
            out->n_top++;
        }
    }
    return (long)n;
}

/* cumulative_logprob (1.3) of a DELTA or a FINAL's outputs entry into c->has_cum / c->cum
 * (src NULL: none); -1 when it is not a number. */
static int parse_cum(pagedrun_client *c, const msgpack_object *src) {
    const msgpack_object *v = src ? map_get(src, "cumulative_logprob") : NULL;
    c->has_cum = 0;
    if (is_nil(v)) return 0;
    if (!is_num(v)) return -1;
    c->has_cum = 1;
    c->cum = as_f64(v);
    return 0;
}

/* Fields of the server's view that replies carry: lease_s (PONG; MODEL_INFO_REPLY `server`) and
 * server_id (1.2: every DELTA, FINAL, ERROR, PONG, MODEL_INFO_REPLY). A changed server_id means
 * the server restarted: the requests the old instance answered, or that were sent before it
 * last spoke (prev_recv_ns), are lost. r: the request this reply belongs to, if any.
 * 0, or -1 when one of these fields has a wrong type. */
static int note_server_fields(pagedrun_client *c, const msgpack_object *body, pr_req *r,
                              int64_t prev_recv_ns) {
    const msgpack_object *server = map_get(body, "server");
    const msgpack_object *lease = map_get(body, "lease_s");
    if (!lease && server) lease = map_get(server, "lease_s");
    if (lease && !is_nil(lease)) {
        if (!is_num(lease)) return -1;
        double v = as_f64(lease);
        if (v > 0) c->info.lease_s = v;
    }
    const msgpack_object *sid_o = map_get(body, "server_id");
    if (!sid_o || is_nil(sid_o)) return 0;
    if (!is_str(sid_o) || sid_o->via.str.size == 0 || sid_o->via.str.size > PAGEDRUN_REQUEST_ID_MAX)
        return -1;
    char sid[PAGEDRUN_REQUEST_ID_BUF];
    obj_str(sid_o, sid, sizeof sid);
    if (r && !r->answered_by[0]) snprintf(r->answered_by, sizeof r->answered_by, "%s", sid);
    if (c->info.server_id[0] && strcmp(sid, c->info.server_id) != 0) {
        char old[PAGEDRUN_REQUEST_ID_BUF];
        snprintf(old, sizeof old, "%s", c->info.server_id);
        snprintf(c->info.server_id, sizeof c->info.server_id, "%s", sid);
        fail_all(c, PAGEDRUN_E_SERVER_UNAVAILABLE, 0, old, prev_recv_ns,
                 "the server restarted (instance %s is now %s): a request sent to the old "
                 "instance is lost", old, sid);
    } else {
        snprintf(c->info.server_id, sizeof c->info.server_id, "%s", sid);
    }
    return 0;
}

static int parse_usage(const msgpack_object *body, pagedrun_usage *u, char *stop_buf,
                       size_t stop_cap) {
    u->prompt_tokens = u->cached_prompt_tokens = u->completion_tokens = -1;
    u->time_to_first_token_s = u->time_per_output_token_s = u->e2e_latency_s = -1;
    u->stop_reason = NULL;
    u->stop_token_id = -1;
    const msgpack_object *usage = map_get(body, "usage"), *metrics = map_get(body, "metrics"),
                         *stop = map_get(body, "stop_reason");
    if (usage && !is_nil(usage)) {
        if (usage->type != MSGPACK_OBJECT_MAP) return -1;
        const char *keys[3] = {"prompt_tokens", "cached_prompt_tokens", "completion_tokens"};
        int64_t *dst[3] = {&u->prompt_tokens, &u->cached_prompt_tokens, &u->completion_tokens};
        for (int i = 0; i < 3; i++) {
            const msgpack_object *v = map_get(usage, keys[i]);
            if (v && !is_nil(v)) {
                if (!is_int(v)) return -1;
                *dst[i] = as_i64(v);
            }
        }
    }
    if (metrics && !is_nil(metrics)) {
        if (metrics->type != MSGPACK_OBJECT_MAP) return -1;
        const char *keys[3] = {"time_to_first_token_s", "time_per_output_token_s",
                               "e2e_latency_s"};
        double *dst[3] = {&u->time_to_first_token_s, &u->time_per_output_token_s,
                          &u->e2e_latency_s};
        for (int i = 0; i < 3; i++) {
            const msgpack_object *v = map_get(metrics, keys[i]);
            if (v && !is_nil(v)) {
                if (!is_num(v)) return -1;
                *dst[i] = as_f64(v);
            }
        }
    }
    if (stop && !is_nil(stop)) {
        if (is_str(stop)) {
            copy_str(stop_buf, stop_cap, stop->via.str.ptr, stop->via.str.size);
            u->stop_reason = stop_buf;
        } else if (is_int(stop)) {
            u->stop_token_id = as_i64(stop);
        } else {
            return -1;
        }
    }
    return 0;
}

/* A DELTA, or the text / token ids / logprobs of a non-streamed FINAL's outputs[0]; validated
 * first, then handed to the callbacks. Returns 0, -1 malformed. On return r may be gone. */
static int deliver_delta(pagedrun_client *c, pr_req *r, const msgpack_object *src,
                         const msgpack_object *prompt_lp, int is_final) {
    const msgpack_object *text = map_get(src, "text"), *ids = map_get(src, "token_ids"),
                         *index = map_get(src, "index"), *lp = map_get(src, "logprobs");
    if (is_final && !text && !ids) text = ids = NULL;
    else if (!is_str(text) || !ids || ids->type != MSGPACK_OBJECT_ARRAY) return -1;
    if (index && !is_nil(index) && !is_int(index)) return -1;
    if (lp && !is_nil(lp) && lp->type != MSGPACK_OBJECT_ARRAY) return -1;
    if (prompt_lp && !is_nil(prompt_lp) && prompt_lp->type != MSGPACK_OBJECT_ARRAY) return -1;
    if (parse_cum(c, src) < 0) return -1;
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    snprintf(rid, sizeof rid, "%s", r->id);
    pagedrun_callbacks cb = r->cb;
    void *user = r->user;
    /* check everything before any callback runs */
    if (prompt_lp && !is_nil(prompt_lp) && parse_logprobs(c, prompt_lp, 1) < 0) return -1;
    if (lp && !is_nil(lp) && parse_logprobs(c, lp, 0) < 0) return -1;
    long n_ids = ids ? parse_ids(c, ids) : 0;
    long n_text = text ? parse_text(c, text) : 0;
    if (n_ids < 0 || n_text < 0) return -1;
    if (!text) {
        if (grow((void **)&c->text, &c->text_cap, 1, 1) < 0) return -1;
        c->text[0] = '\0';
    }
    c->delta_index = index && is_int(index) ? (uint32_t)as_i64(index) : 0;
    r->last_activity_ns = now_ns();
    c->depth++;
    if (prompt_lp && !is_nil(prompt_lp) && cb.on_logprobs) {
        long n = parse_logprobs(c, prompt_lp, 1);
        cb.on_logprobs(c->lps, (size_t)n, 1, user);
    }
    int want_abort = 0;
    if (cb.on_delta && (n_ids > 0 || n_text > 0 || !is_final)) {
        /* c->text / c->ids were filled above and are not touched by on_logprobs' parse */
        want_abort = cb.on_delta(c->text, (size_t)n_text, c->ids, (size_t)n_ids, user);
    }
    if (lp && !is_nil(lp) && cb.on_logprobs) {
        long n = parse_logprobs(c, lp, 0);
        cb.on_logprobs(c->lps, (size_t)n, 0, user);
    }
    c->depth--;
    if (want_abort && !is_final && find_req(c, rid, strlen(rid))) send_simple(c, MSG_ABORT, rid);
    return 0;
}

static void handle_final(pagedrun_client *c, pr_req *r, const msgpack_object *body) {
    const msgpack_object *reason = map_get(body, "finish_reason"),
                         *outputs = map_get(body, "outputs"),
                         *plp = map_get(body, "prompt_logprobs");
    pagedrun_usage usage;
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    snprintf(rid, sizeof rid, "%s", r->id);
    if (!(is_str(reason) || is_nil(reason)) ||
        (outputs && !is_nil(outputs) && outputs->type != MSGPACK_OBJECT_ARRAY) ||
        parse_usage(body, &usage, c->stop_buf, sizeof c->stop_buf) < 0) {
        end_req_error(c, r, PAGEDRUN_E_MALFORMED_REPLY, "malformed FINAL (field types)");
        return;
    }
    const msgpack_object *first = NULL;
    if (outputs && !is_nil(outputs)) {
        for (uint32_t i = 0; i < outputs->via.array.size; i++)
            if (outputs->via.array.ptr[i].type != MSGPACK_OBJECT_MAP) {
                end_req_error(c, r, PAGEDRUN_E_MALFORMED_REPLY, "malformed FINAL (outputs)");
                return;
            }
        if (outputs->via.array.size) first = &outputs->via.array.ptr[0];
    }
    if (parse_cum(c, first) < 0) {
        end_req_error(c, r, PAGEDRUN_E_MALFORMED_REPLY, "malformed FINAL (cumulative_logprob)");
        return;
    }
    if (!r->stream || (plp && !is_nil(plp))) {
        /* whole completion (stream off) and/or prompt logprobs that no DELTA carried */
        static const msgpack_object empty = {MSGPACK_OBJECT_MAP, {0}};
        const msgpack_object *src = (!r->stream && first) ? first : &empty;
        if (deliver_delta(c, r, src, plp, 1) < 0) {
            if ((r = find_req(c, rid, strlen(rid))))
                end_req_error(c, r, PAGEDRUN_E_MALFORMED_REPLY, "malformed FINAL (outputs)");
            return;
        }
        if (!(r = find_req(c, rid, strlen(rid)))) return; /* a callback ended it */
        parse_cum(c, first); /* on_final sees sequence 0's (checked above) */
    }
    char fr[32] = "";
    obj_str(reason, fr, sizeof fr);
    end_req_final(c, r, fr, &usage);
}

static void handle_error_reply(pagedrun_client *c, pr_req *r, const msgpack_object *body) {
    const msgpack_object *code = map_get(body, "code"), *message = map_get(body, "message");
    if (!is_str(code) || !(is_str(message) || is_nil(message))) {
        end_req_error(c, r, PAGEDRUN_E_MALFORMED_REPLY, "malformed ERROR (field types)");
        return;
    }
    char code_s[64] = "", msg[448] = "", full[520];
    obj_str(code, code_s, sizeof code_s);
    obj_str(message, msg, sizeof msg);
    snprintf(full, sizeof full, "[%s] %s", code_s, msg);
    end_req_error(c, r, pagedrun_status_from_code(code_s), full);
}

static int parse_pong(pagedrun_client *c, const msgpack_object *body, pagedrun_pong *p) {
    const msgpack_object *st = map_get(body, "status"), *lease = map_get(body, "lease_s"),
                         *t = map_get(body, "server_time"),
                         *nf = map_get(body, "num_requests_in_flight"),
                         *rev = map_get(body, "protocol_revision");
    if ((st && !is_str(st)) || (lease && !is_num(lease)) || (t && !is_nil(t) && !is_num(t)) ||
        (nf && !is_int(nf)) || (rev && !is_nil(rev) && !is_str(rev)))
        return -1;
    obj_str(st, c->info.status, sizeof c->info.status);
    if (p) {
        memset(p, 0, sizeof *p);
        obj_str(st, p->status, sizeof p->status);
        p->lease_s = lease ? as_f64(lease) : -1;
        p->server_time = t && !is_nil(t) ? as_f64(t) : -1;
        p->num_requests_in_flight = nf ? as_i64(nf) : -1;
        obj_str(rev, p->protocol_revision, sizeof p->protocol_revision);
        snprintf(p->server_id, sizeof p->server_id, "%s", c->info.server_id);
    }
    return 0;
}

static int parse_model_info(pagedrun_client *c, const msgpack_object *body) {
    const msgpack_object *model = map_get(body, "model"), *mml = map_get(body, "max_model_len"),
                         *vs = map_get(body, "vocab_size"), *server = map_get(body, "server");
    if ((model && !is_str(model)) || (mml && !is_int(mml)) || (vs && !is_int(vs)) ||
        (server && server->type != MSGPACK_OBJECT_MAP))
        return -1;
    const msgpack_object *rev = map_get(server, "protocol_revision"),
                         *mmb = map_get(server, "max_message_bytes"),
                         *lora = map_get(body, "enable_lora");
    if ((rev && !is_nil(rev) && !is_str(rev)) || (mmb && !is_int(mmb)) ||
        (!is_nil(lora) && lora->type != MSGPACK_OBJECT_BOOLEAN))
        return -1;
    c->info.enable_lora = is_nil(lora) ? -1 : lora->via.boolean;
    obj_str(model, c->info.model, sizeof c->info.model);
    c->info.max_model_len = mml ? as_i64(mml) : -1;
    c->info.vocab_size = vs ? as_i64(vs) : -1;
    c->info.max_message_bytes = mmb ? as_i64(mmb) : -1;
    obj_str(rev, c->info.protocol_revision, sizeof c->info.protocol_revision);
    return 0;
}

/* A reply to the waiting exchange (c->rpc). */
static void handle_rpc_reply(pagedrun_client *c, int type, const msgpack_object *body) {
    pr_rpc *q = &c->rpc;
    q->done = 1;
    q->status = PAGEDRUN_OK;
    if (type == MSG_ERROR) {
        const msgpack_object *code = map_get(body, "code"), *msg = map_get(body, "message");
        char code_s[64] = "", msg_s[400] = "";
        if (!is_str(code)) {
            q->status = set_err(c, PAGEDRUN_E_MALFORMED_REPLY, "malformed ERROR reply");
            return;
        }
        obj_str(code, code_s, sizeof code_s);
        obj_str(msg, msg_s, sizeof msg_s);
        q->status = set_err(c, pagedrun_status_from_code(code_s), "[%s] %s", code_s, msg_s);
        return;
    }
    if (type != q->expect_type) {
        q->status = set_err(c, PAGEDRUN_E_MALFORMED_REPLY, "reply type 0x%02x, expected 0x%02x",
                            type, q->expect_type);
        return;
    }
    int bad = 0;
    if (type == MSG_PONG) {
        bad = parse_pong(c, body, q->pong);
    } else if (type == MSG_MODEL_INFO_REPLY) {
        bad = parse_model_info(c, body);
    } else if (type == MSG_ABORTED) {
        const msgpack_object *found = map_get(body, "found");
        if (!found || found->type != MSGPACK_OBJECT_BOOLEAN) bad = -1;
        else q->found = found->via.boolean;
    } else if (type == MSG_LORA_REPLY) {
        const msgpack_object *id = map_get(body, "lora_int_id"), *loaded = map_get(body, "loaded");
        if (!is_int(id) || !loaded || loaded->type != MSGPACK_OBJECT_BOOLEAN) {
            bad = -1;
        } else {
            q->lora_int_id = as_i64(id);
            q->lora_loaded = loaded->via.boolean;
        }
    }
    if (bad) q->status = set_err(c, PAGEDRUN_E_MALFORMED_REPLY, "malformed reply 0x%02x", type);
}

/* One whole message (frames already read). */
static void handle_message(pagedrun_client *c, zmq_msg_t *frames, int nframes) {
    int64_t prev_recv_ns = c->last_recv_ns;
    c->progress++;
    c->last_recv_ns = now_ns();
    c->ping_out_ns = 0; /* anything from the server shows it is alive */
    if (nframes != 2 || zmq_msg_size(&frames[0]) != 2) {
        fail_all(c, PAGEDRUN_E_MALFORMED_REPLY, 1, NULL, 0,
                 "malformed reply: %d frame(s), header of %zu byte(s) (want 2 and 2)", nframes,
                 zmq_msg_size(&frames[0]));
        return;
    }
    const unsigned char *hdr = zmq_msg_data(&frames[0]);
    if (hdr[0] != PAGEDRUN_PROTOCOL_VERSION) {
        fail_all(c, PAGEDRUN_E_MALFORMED_REPLY, 1, NULL, 0,
                 "malformed reply: protocol version byte %u (want %u)", hdr[0],
                 PAGEDRUN_PROTOCOL_VERSION);
        return;
    }
    int type = hdr[1];
    msgpack_object body;
    size_t off = 0, size = zmq_msg_size(&frames[1]);
    size_t checked = 0;
    msgpack_zone_clear(&c->zone);
    msgpack_unpack_return ur =
        mp_check(zmq_msg_data(&frames[1]), size, &checked, 0) < 0
            ? MSGPACK_UNPACK_PARSE_ERROR
            : msgpack_unpack(zmq_msg_data(&frames[1]), size, &off, &c->zone, &body);
    if (ur != MSGPACK_UNPACK_SUCCESS || off != size || body.type != MSGPACK_OBJECT_MAP) {
        int trailing = ur == MSGPACK_UNPACK_EXTRA_BYTES ||
                       (ur == MSGPACK_UNPACK_SUCCESS && off != size);
        fail_all(c, PAGEDRUN_E_MALFORMED_REPLY, 1, NULL, 0,
                 "malformed reply: the body of a 0x%02x is %s", type,
                 trailing ? "followed by trailing bytes"
                 : ur == MSGPACK_UNPACK_SUCCESS ? "not a msgpack map" : "not valid msgpack");
        return;
    }
    const msgpack_object *rid_o = map_get(&body, "request_id");
    if (rid_o && !is_nil(rid_o) && !is_str(rid_o)) {
        fail_all(c, PAGEDRUN_E_MALFORMED_REPLY, 1, NULL, 0,
                 "malformed reply: request_id is not a string");
        return;
    }
    const char *rid = is_str(rid_o) ? rid_o->via.str.ptr : NULL;
    size_t rid_n = is_str(rid_o) ? rid_o->via.str.size : 0;
    if (note_server_fields(c, &body, rid ? find_req(c, rid, rid_n) : NULL, prev_recv_ns) < 0) {
        fail_all(c, PAGEDRUN_E_MALFORMED_REPLY, 1, NULL, 0,
                 "malformed reply: lease_s or server_id of a wrong type");
        return;
    }
    /* the waiting exchange: an internal id gets any reply; an ABORT (the request's own id)
     * its ABORTED, and an ERROR only when that request is no longer in flight */
    if (c->rpc.active && !c->rpc.done && rid && strlen(c->rpc.rid) == rid_n &&
        memcmp(c->rpc.rid, rid, rid_n) == 0 &&
        (c->rpc.expect_type != MSG_ABORTED || type == MSG_ABORTED ||
         (type == MSG_ERROR && !find_req(c, rid, rid_n)))) {
        handle_rpc_reply(c, type, &body);
        return;
    }
    if (type == MSG_PONG) {
        if (parse_pong(c, &body, NULL) < 0)
            fail_all(c, PAGEDRUN_E_MALFORMED_REPLY, 1, NULL, 0, "malformed PONG (field types)");
        return; /* heartbeat */
    }
    if (type != MSG_DELTA && type != MSG_FINAL && type != MSG_ERROR) return; /* stale/other */
    pr_req *r = rid ? find_req(c, rid, rid_n) : NULL;
    if (!r) {
        if (type == MSG_ERROR && !rid) { /* an ERROR about a message it could not read */
            const msgpack_object *code = map_get(&body, "code"), *msg = map_get(&body, "message");
            char code_s[64] = "", msg_s[400] = "";
            obj_str(code, code_s, sizeof code_s);
            obj_str(msg, msg_s, sizeof msg_s);
            fail_all(c, is_str(code) ? pagedrun_status_from_code(code_s)
                                     : PAGEDRUN_E_MALFORMED_REPLY,
                     1, NULL, 0, "[%s] %s", code_s, msg_s);
        }
        return; /* replies to requests nobody waits for (aborted, timed out) */
    }
    r->last_activity_ns = c->last_recv_ns;
    if (type == MSG_DELTA) {
        if (!r->stream) {
            send_simple(c, MSG_ABORT, r->id);
            end_req_error(c, r, PAGEDRUN_E_MALFORMED_REPLY, "DELTA for a request without stream");
            return;
        }
        char id[PAGEDRUN_REQUEST_ID_BUF];
        snprintf(id, sizeof id, "%s", r->id);
        if (deliver_delta(c, r, &body, map_get(&body, "prompt_logprobs"), 0) < 0) {
            send_simple(c, MSG_ABORT, id);
            if ((r = find_req(c, id, strlen(id))))
                end_req_error(c, r, PAGEDRUN_E_MALFORMED_REPLY, "malformed DELTA (field types)");
        }
    } else if (type == MSG_FINAL) {
        handle_final(c, r, &body);
    } else {
        handle_error_reply(c, r, &body);
    }
}

/* ---- monitor ----------------------------------------------------------------------------- */
#ifndef ZMQ_EVENT_HANDSHAKE_SUCCEEDED
#define ZMQ_EVENT_HANDSHAKE_SUCCEEDED 0
#define ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL 0
#define ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL 0
#define ZMQ_EVENT_HANDSHAKE_FAILED_AUTH 0
#define PR_NO_HANDSHAKE_EVENTS 1
#endif

static int drain_socket(pagedrun_client *c);

static void handle_monitor_event(pagedrun_client *c, uint16_t event, uint32_t value) {
    (void)value;
#ifdef PR_NO_HANDSHAKE_EVENTS
    if (event == ZMQ_EVENT_CONNECTED) c->handshaken = 1;
#else
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) c->handshaken = 1;
#endif
    if (event == ZMQ_EVENT_DISCONNECTED) {
        int was = c->handshaken;
        c->handshaken = 0;
        c->ping_out_ns = 0;
        if (was) {
            /* replies that came before the connection dropped (a FINAL) are in the pipe */
            if (!c->depth) drain_socket(c);
            c->info.server_id[0] = '\0'; /* whoever answers next may be another instance */
            fail_all(c, PAGEDRUN_E_SERVER_UNAVAILABLE, 0, NULL, 0,
                     "the connection to the server was lost (server stopped or restarted)");
        }
    } else if (event && (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL ||
                         event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                         event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)) {
        fail_all(c, PAGEDRUN_E_CONNECTION, 0, NULL, 0,
                 "the handshake with the server failed (%s)",
                 event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH ? "authentication: CURVE key refused"
                 : event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL
                     ? "protocol: wrong CURVE server key or not a ZeroMQ peer"
                     : "no detail");
    }
}

static void drain_monitor(pagedrun_client *c) {
    while (c->mon) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, c->mon, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        uint16_t event = 0;
        uint32_t value = 0;
        int ok = zmq_msg_size(&m) == 6;
        if (ok) {
            memcpy(&event, zmq_msg_data(&m), 2);
            memcpy(&value, (char *)zmq_msg_data(&m) + 2, 4);
        }
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        while (more) { /* the endpoint frame */
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, c->mon, 0) < 0) more = 0;
            else more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (ok) handle_monitor_event(c, event, value);
    }
}

/* ---- the pump ---------------------------------------------------------------------------- */
/* Reads every whole message available now; 0, or -status on a socket failure. */
static int drain_socket(pagedrun_client *c) {
    for (int count = 0; c->sock && count < MAX_MESSAGES_PER_PUMP; count++) {
        zmq_msg_t frames[MAX_FRAMES_KEPT];
        int nframes = 0, more = 1, rc = 0;
        while (more) { /* every frame of one message; the first MAX_FRAMES_KEPT are kept */
            zmq_msg_t extra, *m = nframes < MAX_FRAMES_KEPT ? &frames[nframes] : &extra;
            zmq_msg_init(m);
            rc = zmq_msg_recv(m, c->sock, nframes == 0 ? ZMQ_DONTWAIT : 0);
            if (rc < 0) {
                zmq_msg_close(m);
                break;
            }
            more = zmq_msg_more(m);
            if (m == &extra) zmq_msg_close(m);
            nframes++;
        }
        if (rc < 0) {
            int e = zmq_errno();
            for (int i = 0; i < nframes && i < MAX_FRAMES_KEPT; i++) zmq_msg_close(&frames[i]);
            if (nframes == 0 && e == EAGAIN) return 0;
            if (e == EINTR) continue;
            set_err(c, PAGEDRUN_E_CONNECTION, "recv: %s", zmq_strerror(e));
            return -PAGEDRUN_E_CONNECTION;
        }
        handle_message(c, frames, nframes);
        for (int i = 0; i < nframes && i < MAX_FRAMES_KEPT; i++) zmq_msg_close(&frames[i]);
    }
    return 0;
}

static int waiting(const pagedrun_client *c) {
    return c->n_reqs > 0 || (c->rpc.active && !c->rpc.done);
}

/* Heartbeats, liveness, per-request timeouts; returns the next time a timer is due. */
static int64_t run_timers(pagedrun_client *c) {
    int64_t now = now_ns(), next = INT64_MAX;
    if (!waiting(c) || !c->sock) return next;
    int64_t hb = keepalive_ns(c), quiet = silence_ns(c), pto = ping_timeout_ns(c);
    /* only connect's handshake waits: connect_timeout_s bounds it, not the PING */
    int liveness = c->n_reqs || !(c->rpc.active && c->rpc.is_connect);
    if (liveness && c->ping_out_ns && now - c->ping_out_ns >= pto) {
        c->ping_out_ns = 0;
        fail_all(c, PAGEDRUN_E_SERVER_UNAVAILABLE, 1, NULL, 0,
                 "the server did not answer a PING within %.3g s", (double)pto / NS_PER_S);
        if (!waiting(c)) return next;
        now = now_ns();
    }
    /* Lease: send something every keepalive interval (at once while the lease is unknown).
     * Liveness: probe when the server was silent for max(2 s, that), and at once while the
     * monitor says no connection is up (the server is down: fail within ping_timeout_s). */
    if (now - c->last_sent_ns >= hb || (!c->ping_out_ns && now - c->last_recv_ns >= quiet) ||
        (!c->ping_out_ns && (c->info.lease_s <= 0 || (c->mon && !c->handshaken)))) {
        int rc = send_ping(c);
        if (rc != PAGEDRUN_OK) {
            fail_all(c, rc, 0, NULL, 0, "%s", c->err);
            return next;
        }
    }
    int64_t t = c->last_sent_ns + hb;
    if (!c->ping_out_ns && c->last_recv_ns + quiet < t) t = c->last_recv_ns + quiet;
    if (t < next) next = t;
    if (liveness && c->ping_out_ns && c->ping_out_ns + pto < next) next = c->ping_out_ns + pto;
    /* per-request timeouts */
    for (size_t i = 0; i < c->n_reqs;) {
        pr_req *r = c->reqs[i];
        int64_t due = r->last_activity_ns + r->timeout_ns;
        if (r->deadline_ns && r->deadline_ns < due) due = r->deadline_ns;
        if (now >= due) {
            char msg[200];
            snprintf(msg, sizeof msg, "no reply for request %s within %.3g s", r->id,
                     r->deadline_ns && now >= r->deadline_ns
                         ? (double)(r->deadline_ns - (r->last_activity_ns)) / NS_PER_S
                         : (double)r->timeout_ns / NS_PER_S);
            send_simple(c, MSG_ABORT, r->id);
            end_req_error(c, r, PAGEDRUN_E_TIMEOUT, msg);
            i = 0; /* the table changed */
            continue;
        }
        if (due < next) next = due;
        i++;
    }
    if (c->rpc.active && !c->rpc.done) {
        if (now >= c->rpc.deadline_ns) {
            c->rpc.done = 1;
            c->progress++;
            c->rpc.status = set_err(c, PAGEDRUN_E_TIMEOUT, "no reply to %s within the timeout",
                                    c->rpc.rid);
        } else if (c->rpc.deadline_ns < next) {
            next = c->rpc.deadline_ns;
        }
    }
    return next;
}

/* One round: handle what is there; if that changed nothing, wait until something arrives, a
 * timer is due, or until_ns, and handle that. */
static int pump(pagedrun_client *c, int64_t until_ns) {
    if (!c->sock) return -set_err(c, PAGEDRUN_E_CONNECTION, "not connected");
    uint64_t progress = c->progress;
    int rc = drain_socket(c);
    if (rc < 0) return rc;
    drain_monitor(c);
    int64_t next = run_timers(c);
    if (c->progress != progress) return 0; /* the caller looks again before waiting */
    if (next == INT64_MAX && until_ns == INT64_MAX) return 0; /* nothing to wait for */
    if (until_ns < next) next = until_ns;
    int64_t now = now_ns();
    long timeout_ms;
    if (next == INT64_MAX) timeout_ms = -1;
    else if (next <= now) timeout_ms = 0;
    else timeout_ms = (long)((next - now + 999999) / 1000000);
    if (timeout_ms > 1000000) timeout_ms = 1000000;
    zmq_pollitem_t items[2] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0}};
    int n = zmq_poll(items, c->mon ? 2 : 1, timeout_ms);
    if (n < 0 && zmq_errno() != EINTR) {
        set_err(c, PAGEDRUN_E_CONNECTION, "poll: %s", zmq_strerror(zmq_errno()));
        return -PAGEDRUN_E_CONNECTION;
    }
    rc = drain_socket(c);
    if (rc < 0) return rc;
    drain_monitor(c);
    run_timers(c);
    return 0;
}

int pagedrun_poll(pagedrun_client *c, int timeout_ms) {
    if (!c) return -PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth) return -set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    int64_t until = timeout_ms < 0 ? INT64_MAX : now_ns() + (int64_t)timeout_ms * 1000000;
    int rc = pump(c, until);
    return rc < 0 ? rc : (int)c->n_reqs;
}

/* Waits for the exchange set up in c->rpc (already sent). */
static int rpc_wait(pagedrun_client *c) {
    while (!c->rpc.done) {
        int rc = pump(c, c->rpc.deadline_ns);
        if (rc < 0) {
            c->rpc.active = 0;
            return -rc;
        }
    }
    c->rpc.active = 0;
    return c->rpc.status;
}

/* Sets up c->rpc for a reply of expect_type to rid (not active until the request is sent). */
static void rpc_arm(pagedrun_client *c, int expect_type, const char *rid, double timeout_s) {
    memset(&c->rpc, 0, sizeof c->rpc);
    snprintf(c->rpc.rid, sizeof c->rpc.rid, "%s", rid);
    c->rpc.expect_type = expect_type;
    c->rpc.deadline_ns = now_ns() + s_to_ns(timeout_s > 0 ? timeout_s : c->opts.timeout_s);
}

static int rpc_start(pagedrun_client *c, int send_type, int expect_type, const char *rid,
                     double timeout_s) {
    rpc_arm(c, expect_type, rid, timeout_s);
    int rc = send_simple(c, send_type, rid);
    if (rc != PAGEDRUN_OK) return rc;
    c->rpc.active = 1;
    return PAGEDRUN_OK;
}

/* ---- connect / disconnect ---------------------------------------------------------------- */
static void close_sockets(pagedrun_client *c, int linger_ms) {
    if (c->mon) {
        zmq_close(c->mon);
        c->mon = NULL;
    }
    if (c->sock) {
        zmq_socket_monitor(c->sock, NULL, 0);
        zmq_setsockopt(c->sock, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
        zmq_close(c->sock);
        c->sock = NULL;
    }
    c->handshaken = 0;
}

static int open_socket(pagedrun_client *c) {
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (!c->sock) return set_err(c, PAGEDRUN_E_CONNECTION, "socket: %s", zmq_strerror(zmq_errno()));
    int linger = c->opts.linger_ms;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    if (c->opts.server_public_key) {
        if (!zmq_has("curve"))
            return set_err(c, PAGEDRUN_E_CONNECTION, "this libzmq has no CURVE support");
        char pub[41], sec[41];
        if (c->opts.client_public_key && c->opts.client_secret_key) {
            snprintf(pub, sizeof pub, "%s", c->opts.client_public_key);
            snprintf(sec, sizeof sec, "%s", c->opts.client_secret_key);
        } else if (!c->opts.client_public_key && !c->opts.client_secret_key) {
            if (zmq_curve_keypair(pub, sec) != 0)
                return set_err(c, PAGEDRUN_E_CONNECTION, "curve keypair: %s",
                               zmq_strerror(zmq_errno()));
        } else {
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                           "CURVE: give both client keys or neither");
        }
        if (strlen(c->opts.server_public_key) != 40 || strlen(pub) != 40 || strlen(sec) != 40)
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                           "CURVE keys must be 40-character Z85 strings");
        if (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, c->opts.server_public_key, 41) != 0 ||
            zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, pub, 41) != 0 ||
            zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, sec, 41) != 0)
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "CURVE keys rejected: %s",
                           zmq_strerror(zmq_errno()));
    }
    char mon_ep[64];
    snprintf(mon_ep, sizeof mon_ep, "inproc://pagedrun-monitor-%u", ++c->mon_seq);
    int events = ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED;
#ifndef PR_NO_HANDSHAKE_EVENTS
    events |= ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
              ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
#endif
    if (zmq_socket_monitor(c->sock, mon_ep, events) == 0) {
        c->mon = zmq_socket(c->ctx, ZMQ_PAIR);
        if (c->mon && zmq_connect(c->mon, mon_ep) != 0) {
            zmq_close(c->mon);
            c->mon = NULL;
        }
    }
    if (zmq_connect(c->sock, c->endpoint) != 0)
        return set_err(c, PAGEDRUN_E_CONNECTION, "connect %s: %s", c->endpoint,
                       zmq_strerror(zmq_errno()));
    return PAGEDRUN_OK;
}

int pagedrun_connect(pagedrun_client *c, const char *endpoint) {
    if (!c || !endpoint || !*endpoint) return PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    if (c->sock) pagedrun_disconnect(c);
    char *ep = strdup(endpoint);
    if (!ep) return set_err(c, PAGEDRUN_E_NO_MEMORY, "out of memory");
    free(c->endpoint);
    c->endpoint = ep;
    c->err[0] = '\0';
    reset_info(&c->info);
    c->last_sent_ns = c->last_recv_ns = c->ping_out_ns = 0;
    int rc = open_socket(c);
    if (rc != PAGEDRUN_OK) {
        close_sockets(c, 0);
        return rc;
    }
    if (c->opts.connect_timeout_s <= 0) return PAGEDRUN_OK;
    char rid[32];
    snprintf(rid, sizeof rid, "_mi%llu", (unsigned long long)++c->seq);
    rc = rpc_start(c, MSG_MODEL_INFO, MSG_MODEL_INFO_REPLY, rid, c->opts.connect_timeout_s);
    c->rpc.is_connect = 1;
    if (rc == PAGEDRUN_OK) rc = rpc_wait(c);
    if (rc == PAGEDRUN_E_TIMEOUT)
        rc = set_err(c, PAGEDRUN_E_SERVER_UNAVAILABLE, "no answer from %s within %.3g s",
                     endpoint, c->opts.connect_timeout_s);
    return rc;
}

int pagedrun_disconnect(pagedrun_client *c) {
    if (!c) return PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    if (!c->sock) return PAGEDRUN_OK;
    drain_monitor(c);
    int alive = c->handshaken;
    fail_all(c, PAGEDRUN_E_CONNECTION, alive, NULL, 0, "disconnected by the client");
    close_sockets(c, alive ? c->opts.linger_ms : 0);
    return PAGEDRUN_OK;
}

int pagedrun_reconnect(pagedrun_client *c) {
    if (!c || !c->endpoint) return PAGEDRUN_E_INVALID_ARGUMENT;
    char *ep = strdup(c->endpoint);
    if (!ep) return set_err(c, PAGEDRUN_E_NO_MEMORY, "out of memory");
    int rc = pagedrun_connect(c, ep);
    free(ep);
    return rc;
}

void pagedrun_client_free(pagedrun_client *c) {
    if (!c) return;
    c->depth = 0;
    pagedrun_disconnect(c);
    zmq_ctx_term(c->ctx);
    msgpack_sbuffer_destroy(&c->sbuf);
    msgpack_zone_destroy(&c->zone);
    free(c->reqs);
    free(c->endpoint);
    free(c->text);
    free(c->ids);
    free(c->lps);
    free(c->top_ids);
    free(c->top_lps);
    free((void *)c->top_toks);
    free(c->tok_buf);
    free(c);
}

/* ---- ping / abort ------------------------------------------------------------------------ */
int pagedrun_ping(pagedrun_client *c, double timeout_s, pagedrun_pong *out) {
    if (!c) return PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    char rid[32];
    snprintf(rid, sizeof rid, "_pg%llu", (unsigned long long)++c->seq);
    int64_t t0 = now_ns();
    int rc = rpc_start(c, MSG_PING, MSG_PONG, rid, timeout_s);
    c->rpc.pong = out;
    if (rc == PAGEDRUN_OK) rc = rpc_wait(c);
    if (rc == PAGEDRUN_OK && out) out->round_trip_s = (double)(now_ns() - t0) / NS_PER_S;
    return rc;
}

int pagedrun_abort(pagedrun_client *c, const char *request_id, int *found) {
    if (!c || !request_id || !*request_id || strlen(request_id) > PAGEDRUN_REQUEST_ID_MAX)
        return PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth && found)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                       "pagedrun_abort from a callback: pass found = NULL");
    if (!found) return send_simple(c, MSG_ABORT, request_id);
    int rc = rpc_start(c, MSG_ABORT, MSG_ABORTED, request_id, 0);
    if (rc == PAGEDRUN_OK) rc = rpc_wait(c);
    if (rc == PAGEDRUN_OK) *found = c->rpc.found;
    return rc;
}

/* ---- generate ---------------------------------------------------------------------------- */
static int valid_rid(const char *rid) {
    size_t n = strlen(rid);
    return n >= 1 && n <= PAGEDRUN_REQUEST_ID_MAX;
}

static int pack_sampling(pagedrun_client *c, msgpack_packer *pk, const pagedrun_sampling *s) {
    const char *fnames[6] = {"temperature", "top_p", "min_p", "repetition_penalty",
                             "presence_penalty", "frequency_penalty"};
    double fvals[6] = {s->temperature, s->top_p, s->min_p, s->repetition_penalty,
                       s->presence_penalty, s->frequency_penalty};
    const char *inames[7] = {"top_k", "seed", "max_tokens", "min_tokens", "n", "logprobs",
                             "prompt_logprobs"};
    int64_t ivals[7] = {s->top_k, s->seed, s->max_tokens, s->min_tokens, s->n, s->logprobs,
                        s->prompt_logprobs};
    const char *bnames[3] = {"ignore_eos", "include_stop_str_in_output", "skip_special_tokens"};
    int bvals[3] = {s->ignore_eos, s->include_stop_str_in_output, s->skip_special_tokens};
    uint32_t count = 0, extra_count = 0;
    msgpack_object extra;
    /* its own zone: c->zone may hold the reply being dispatched (submit from a callback) */
    msgpack_zone zone;
    if (!msgpack_zone_init(&zone, 256)) return set_err(c, PAGEDRUN_E_NO_MEMORY, "out of memory");
    if (s->extra_msgpack && s->extra_msgpack_len) {
        size_t off = 0;
        size_t checked = 0;
        if (mp_check(s->extra_msgpack, s->extra_msgpack_len, &checked, 0) < 0 ||
            msgpack_unpack(s->extra_msgpack, s->extra_msgpack_len, &off, &zone, &extra) !=
                MSGPACK_UNPACK_SUCCESS ||
            off != s->extra_msgpack_len || extra.type != MSGPACK_OBJECT_MAP) {
            msgpack_zone_destroy(&zone);
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                           "sampling.extra_msgpack must be exactly one msgpack map");
        }
        extra_count = extra.via.map.size;
    }
    for (int i = 0; i < 6; i++) count += fvals[i] > PAGEDRUN_UNSET_FLOAT / 10;
    for (int i = 0; i < 7; i++) count += ivals[i] != PAGEDRUN_UNSET_INT;
    for (int i = 0; i < 3; i++) count += bvals[i] == 0 || bvals[i] == 1;
    count += s->n_stop > 0;
    count += s->n_stop_token_ids > 0;
    int bad = s->n_stop_token_ids && !s->stop_token_ids;
    for (size_t i = 0; i < s->n_stop; i++) bad |= !s->stop || !s->stop[i];
    if (bad) {
        msgpack_zone_destroy(&zone);
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "sampling: NULL stop / stop_token_ids");
    }
    msgpack_pack_map(pk, count + extra_count);
    for (int i = 0; i < 6; i++)
        if (fvals[i] > PAGEDRUN_UNSET_FLOAT / 10) {
            pack_cstr(pk, fnames[i]);
            msgpack_pack_double(pk, fvals[i]);
        }
    for (int i = 0; i < 7; i++)
        if (ivals[i] != PAGEDRUN_UNSET_INT) {
            pack_cstr(pk, inames[i]);
            if (i == 2 && ivals[i] == PAGEDRUN_MAX_TOKENS_NONE) msgpack_pack_nil(pk);
            else msgpack_pack_int64(pk, ivals[i]);
        }
    for (int i = 0; i < 3; i++)
        if (bvals[i] == 0 || bvals[i] == 1) {
            pack_cstr(pk, bnames[i]);
            if (bvals[i]) msgpack_pack_true(pk);
            else msgpack_pack_false(pk);
        }
    if (s->n_stop) {
        pack_cstr(pk, "stop");
        msgpack_pack_array(pk, s->n_stop);
        for (size_t i = 0; i < s->n_stop; i++) pack_cstr(pk, s->stop[i]);
    }
    if (s->n_stop_token_ids) {
        pack_cstr(pk, "stop_token_ids");
        msgpack_pack_array(pk, s->n_stop_token_ids);
        for (size_t i = 0; i < s->n_stop_token_ids; i++)
            msgpack_pack_int32(pk, s->stop_token_ids[i]);
    }
    for (uint32_t i = 0; i < extra_count; i++) {
        msgpack_pack_object(pk, extra.via.map.ptr[i].key);
        msgpack_pack_object(pk, extra.via.map.ptr[i].val);
    }
    msgpack_zone_destroy(&zone);
    return PAGEDRUN_OK;
}

/* ---- request_ext (library 1.2, protocol 1.4) --------------------------------------------- */
/* The number of characters (code points) of UTF-8 text: what the server's limits count. */
static size_t utf8_chars(const char *s) {
    size_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static int check_text(pagedrun_client *c, const char *field, const char *v, size_t min_chars,
                      size_t max_chars) {
    if (!v) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "%s is NULL", field);
    size_t n = utf8_chars(v);
    if (n < min_chars || n > max_chars)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                       "%s: must be a string of %zu to %zu characters (got %zu)", field,
                       min_chars, max_chars, n);
    return PAGEDRUN_OK;
}

/* The caller's ext as this library knows it: the fields that lie within its struct_size, the
 * others unset. Bytes past this library's struct must be zero: a field a later library added
 * and the caller set would otherwise be dropped without a word. */
static int read_ext(pagedrun_client *c, const pagedrun_request_ext *in, pagedrun_request_ext *e) {
    pagedrun_request_ext_init(e);
    if (!in) return PAGEDRUN_OK;
    size_t size = in->struct_size;
    if (size < sizeof in->struct_size)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                       "pagedrun_request_ext: struct_size is not set "
                       "(initialize it with pagedrun_request_ext_init)");
    for (size_t i = sizeof *e; i < size; i++)
        if (((const unsigned char *)in)[i])
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                           "pagedrun_request_ext: fields this library (%d.%d) does not know are "
                           "set (struct_size %zu > %zu)", PAGEDRUN_CLIENT_VERSION_MAJOR,
                           PAGEDRUN_CLIENT_VERSION_MINOR, size, sizeof *e);
#define EXT_COPY(f) \
    if (size >= offsetof(pagedrun_request_ext, f) + sizeof in->f) e->f = in->f
    EXT_COPY(lora_name);
    EXT_COPY(chat_template);
    EXT_COPY(add_generation_prompt);
    EXT_COPY(continue_final_message);
    EXT_COPY(tools_msgpack);
    EXT_COPY(tools_msgpack_len);
    EXT_COPY(chat_template_kwargs_msgpack);
    EXT_COPY(chat_template_kwargs_msgpack_len);
#undef EXT_COPY
    return PAGEDRUN_OK;
}

/* Whether data is exactly one msgpack array of at most max maps (want_map 0), or one map of at
 * most max entries with string keys (want_map 1). */
static int check_packed(pagedrun_client *c, const char *field, const void *data, size_t len,
                        int want_map, uint32_t max) {
    msgpack_zone zone;
    if (!msgpack_zone_init(&zone, 256)) return set_err(c, PAGEDRUN_E_NO_MEMORY, "out of memory");
    msgpack_object o;
    size_t off = 0, checked = 0;
    int ok = len > 0 && mp_check(data, len, &checked, 0) == 0 &&
             msgpack_unpack(data, len, &off, &zone, &o) == MSGPACK_UNPACK_SUCCESS &&
             off == len && o.type == (want_map ? MSGPACK_OBJECT_MAP : MSGPACK_OBJECT_ARRAY);
    uint32_t n = !ok ? 0 : want_map ? o.via.map.size : o.via.array.size;
    for (uint32_t i = 0; ok && i < n; i++)
        ok = want_map ? o.via.map.ptr[i].key.type == MSGPACK_OBJECT_STR
                      : o.via.array.ptr[i].type == MSGPACK_OBJECT_MAP;
    msgpack_zone_destroy(&zone);
    if (!ok)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "%s must be exactly one msgpack %s", field,
                       want_map ? "map with string keys" : "array of maps");
    if (n > max)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "%s: at most %u %s (got %u)", field,
                       (unsigned)max, want_map ? "entries" : "tools", (unsigned)n);
    return PAGEDRUN_OK;
}

/* Client-side checks of ext against req (docs/protocol.md, GENERATE). */
static int check_ext(pagedrun_client *c, const pagedrun_request *req,
                     const pagedrun_request_ext *e) {
    if (e->lora_name) {
        int rc = check_text(c, "lora_name", e->lora_name, 1, MAX_LORA_NAME_CHARS);
        if (rc != PAGEDRUN_OK) return rc;
    }
    const char *bools[2] = {"add_generation_prompt", "continue_final_message"};
    int bvals[2] = {e->add_generation_prompt, e->continue_final_message};
    for (int i = 0; i < 2; i++)
        if (bvals[i] < -1 || bvals[i] > 1)
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                           "%s must be -1 (unset), 0 or 1 (got %d)", bools[i], bvals[i]);
    const char *chat_opt = e->chat_template ? "chat_template"
                           : bvals[0] != -1 ? bools[0]
                           : bvals[1] != -1 ? bools[1]
                           : e->tools_msgpack ? "tools"
                           : e->chat_template_kwargs_msgpack ? "chat_template_kwargs" : NULL;
    if (chat_opt && req->n_messages == 0)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                       "%s is a chat option: it needs messages (not prompt / prompt_token_ids)",
                       chat_opt);
    if (e->chat_template && utf8_chars(e->chat_template) > MAX_CHAT_TEMPLATE_CHARS)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "chat_template: at most %d characters",
                       MAX_CHAT_TEMPLATE_CHARS);
    if (e->tools_msgpack) {
        int rc = check_packed(c, "tools_msgpack", e->tools_msgpack, e->tools_msgpack_len, 0,
                              MAX_TOOLS);
        if (rc != PAGEDRUN_OK) return rc;
    }
    if (e->chat_template_kwargs_msgpack)
        return check_packed(c, "chat_template_kwargs_msgpack", e->chat_template_kwargs_msgpack,
                            e->chat_template_kwargs_msgpack_len, 1, MAX_CHAT_TEMPLATE_KWARGS);
    return PAGEDRUN_OK;
}

/* The ext fields that are set, as GENERATE body entries; their count first. */
static uint32_t ext_count(const pagedrun_request_ext *e) {
    return (e->lora_name != NULL) + (e->chat_template != NULL) +
           (e->add_generation_prompt != -1) + (e->continue_final_message != -1) +
           (e->tools_msgpack != NULL) + (e->chat_template_kwargs_msgpack != NULL);
}

static void pack_bool(msgpack_packer *pk, int v) {
    if (v) msgpack_pack_true(pk);
    else msgpack_pack_false(pk);
}

static void pack_ext(pagedrun_client *c, msgpack_packer *pk, const pagedrun_request_ext *e) {
    if (e->lora_name) {
        pack_cstr(pk, "lora_name");
        pack_cstr(pk, e->lora_name);
    }
    if (e->chat_template) {
        pack_cstr(pk, "chat_template");
        pack_cstr(pk, e->chat_template);
    }
    if (e->add_generation_prompt != -1) {
        pack_cstr(pk, "add_generation_prompt");
        pack_bool(pk, e->add_generation_prompt);
    }
    if (e->continue_final_message != -1) {
        pack_cstr(pk, "continue_final_message");
        pack_bool(pk, e->continue_final_message);
    }
    /* checked above to be exactly one value each: their bytes go in as they are */
    if (e->tools_msgpack) {
        pack_cstr(pk, "tools");
        msgpack_sbuffer_write(&c->sbuf, e->tools_msgpack, e->tools_msgpack_len);
    }
    if (e->chat_template_kwargs_msgpack) {
        pack_cstr(pk, "chat_template_kwargs");
        msgpack_sbuffer_write(&c->sbuf, e->chat_template_kwargs_msgpack,
                              e->chat_template_kwargs_msgpack_len);
    }
}

static int submit(pagedrun_client *c, const pagedrun_request *req,
                  const pagedrun_request_ext *ext_in, const pagedrun_callbacks *cb,
                  void *user, char *id_out, int stream) {
    if (!c || !req) return PAGEDRUN_E_INVALID_ARGUMENT;
    if (!c->sock) return set_err(c, PAGEDRUN_E_CONNECTION, "not connected");
    int prompts = (req->prompt != NULL) + (req->n_prompt_token_ids > 0) + (req->n_messages > 0);
    if (prompts != 1)
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT,
                       "give exactly one of prompt, prompt_token_ids, messages");
    if ((req->n_prompt_token_ids && !req->prompt_token_ids) ||
        (req->n_messages && !req->messages))
        return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "NULL prompt_token_ids / messages");
    for (size_t i = 0; i < req->n_messages; i++)
        if (!req->messages[i].role || !req->messages[i].content)
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "messages[%zu]: NULL role/content", i);
    pagedrun_request_ext ext;
    int ext_rc = read_ext(c, ext_in, &ext);
    if (ext_rc == PAGEDRUN_OK) ext_rc = check_ext(c, req, &ext);
    if (ext_rc != PAGEDRUN_OK) return ext_rc;
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    if (req->request_id) {
        if (!valid_rid(req->request_id))
            return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "request_id must be 1..128 chars");
        snprintf(rid, sizeof rid, "%s", req->request_id);
    } else {
        snprintf(rid, sizeof rid, "c-%llu", (unsigned long long)++c->seq);
    }
    if (find_req(c, rid, strlen(rid)))
        return set_err(c, PAGEDRUN_E_DUPLICATE_REQUEST_ID, "request id %s is in flight", rid);
    /* a connection lost before now must not be blamed on this request */
    if (!c->depth) drain_monitor(c);

    msgpack_packer pk;
    msgpack_sbuffer_clear(&c->sbuf);
    msgpack_packer_init(&pk, &c->sbuf, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, (req->sampling ? 4 : 3) + ext_count(&ext));
    pack_cstr(&pk, "request_id");
    pack_cstr(&pk, rid);
    pack_cstr(&pk, "stream");
    if (stream) msgpack_pack_true(&pk);
    else msgpack_pack_false(&pk);
    if (req->prompt) {
        pack_cstr(&pk, "prompt");
        pack_cstr(&pk, req->prompt);
    } else if (req->n_prompt_token_ids) {
        pack_cstr(&pk, "prompt_token_ids");
        msgpack_pack_array(&pk, req->n_prompt_token_ids);
        for (size_t i = 0; i < req->n_prompt_token_ids; i++)
            msgpack_pack_int32(&pk, req->prompt_token_ids[i]);
    } else {
        pack_cstr(&pk, "messages");
        msgpack_pack_array(&pk, req->n_messages);
        for (size_t i = 0; i < req->n_messages; i++) {
            msgpack_pack_map(&pk, 2);
            pack_cstr(&pk, "role");
            pack_cstr(&pk, req->messages[i].role);
            pack_cstr(&pk, "content");
            pack_cstr(&pk, req->messages[i].content);
        }
    }
    if (req->sampling) {
        pack_cstr(&pk, "sampling_params");
        int rc = pack_sampling(c, &pk, req->sampling);
        if (rc != PAGEDRUN_OK) return rc;
    }
    pack_ext(c, &pk, &ext);
    pr_req *r = calloc(1, sizeof *r);
    if (!r || grow((void **)&c->reqs, &c->cap_reqs, c->n_reqs + 1, sizeof(pr_req *)) < 0) {
        free(r);
        return set_err(c, PAGEDRUN_E_NO_MEMORY, "out of memory");
    }
    snprintf(r->id, sizeof r->id, "%s", rid);
    if (cb) r->cb = *cb;
    r->user = user;
    r->stream = stream;
    r->timeout_ns = s_to_ns(req->timeout_s > 0 ? req->timeout_s : c->opts.timeout_s);
    int rc = send_frames(c, MSG_GENERATE);
    if (rc != PAGEDRUN_OK) {
        free(r);
        return rc;
    }
    r->last_activity_ns = r->sent_ns = c->last_sent_ns;
    r->deadline_ns = req->deadline_s > 0 ? c->last_sent_ns + s_to_ns(req->deadline_s) : 0;
    c->reqs[c->n_reqs++] = r;
    if (id_out) snprintf(id_out, PAGEDRUN_REQUEST_ID_BUF, "%s", rid);
    return PAGEDRUN_OK;
}

int pagedrun_submit(pagedrun_client *c, const pagedrun_request *req,
                    const pagedrun_callbacks *callbacks, void *user, char *id_out) {
    return submit(c, req, NULL, callbacks, user, id_out, 1);
}

int pagedrun_submit_ext(pagedrun_client *c, const pagedrun_request *req,
                        const pagedrun_request_ext *ext, const pagedrun_callbacks *callbacks,
                        void *user, char *id_out) {
    return submit(c, req, ext, callbacks, user, id_out, 1);
}

int pagedrun_wait(pagedrun_client *c, const char *request_id) {
    if (!c || !request_id) return PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    if (!find_req(c, request_id, strlen(request_id)))
        return set_err(c, PAGEDRUN_E_NOT_FOUND, "request %s is not in flight", request_id);
    c->wait.active = 1;
    c->wait.done = 0;
    snprintf(c->wait.rid, sizeof c->wait.rid, "%s", request_id);
    int status = PAGEDRUN_OK;
    while (!c->wait.done) {
        int rc = pump(c, INT64_MAX);
        if (rc < 0) {
            pr_req *r = find_req(c, request_id, strlen(request_id));
            if (r) end_req_error(c, r, -rc, c->err);
            break;
        }
    }
    status = c->wait.status;
    c->wait.active = 0;
    return status;
}

int pagedrun_stream_ext(pagedrun_client *c, const pagedrun_request *req,
                        const pagedrun_request_ext *ext, const pagedrun_callbacks *callbacks,
                        void *user) {
    if (c && c->depth) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    int rc = submit(c, req, ext, callbacks, user, rid, 1);
    return rc != PAGEDRUN_OK ? rc : pagedrun_wait(c, rid);
}

int pagedrun_stream(pagedrun_client *c, const pagedrun_request *req,
                    const pagedrun_callbacks *callbacks, void *user) {
    return pagedrun_stream_ext(c, req, NULL, callbacks, user);
}

/* pagedrun_generate: callbacks that fill a pagedrun_completion */
typedef struct {
    pagedrun_completion *out;
    int oom;
    pagedrun_client *client;
    int has_cum; /* the FINAL's cumulative_logprob, for pagedrun_cumulative_logprob after */
    double cum;
} gen_acc;

static int gen_on_delta(const char *text, size_t text_len, const int32_t *ids, size_t n_ids,
                        void *user) {
    gen_acc *a = user;
    pagedrun_completion *o = a->out;
    char *t = realloc(o->text, o->text_len + text_len + 1);
    int32_t *p = realloc(o->token_ids, (o->n_tokens + n_ids + 1) * sizeof(int32_t));
    if (t) o->text = t;
    if (p) o->token_ids = p;
    if (!t || !p) {
        a->oom = 1;
        return 1;
    }
    memcpy(o->text + o->text_len, text, text_len);
    o->text_len += text_len;
    o->text[o->text_len] = '\0';
    if (n_ids) memcpy(o->token_ids + o->n_tokens, ids, n_ids * sizeof(int32_t));
    o->n_tokens += n_ids;
    return 0;
}

static void gen_on_final(const char *finish_reason, const pagedrun_usage *usage, void *user) {
    gen_acc *a = user;
    pagedrun_completion *o = a->out;
    a->has_cum = pagedrun_cumulative_logprob(a->client, &a->cum);
    snprintf(o->finish_reason, sizeof o->finish_reason, "%s", finish_reason);
    o->usage = *usage;
    if (usage->stop_reason) {
        snprintf(o->stop_reason_buf, sizeof o->stop_reason_buf, "%s", usage->stop_reason);
        o->usage.stop_reason = o->stop_reason_buf;
    }
}

static void gen_on_error(int status, const char *message, void *user) {
    pagedrun_completion *o = ((gen_acc *)user)->out;
    (void)status;
    snprintf(o->error_message, sizeof o->error_message, "%s", message);
}

int pagedrun_generate_ext(pagedrun_client *c, const pagedrun_request *req,
                          const pagedrun_request_ext *ext, pagedrun_completion *out) {
    if (!out) return PAGEDRUN_E_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->usage.prompt_tokens = out->usage.cached_prompt_tokens = out->usage.completion_tokens = -1;
    out->usage.stop_token_id = -1;
    if (!c) return PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    gen_acc acc = {out, 0, c, 0, 0.0};
    pagedrun_callbacks cb = {gen_on_delta, gen_on_final, gen_on_error, NULL};
    int rc = submit(c, req, ext, &cb, &acc, out->request_id, 0);
    if (rc == PAGEDRUN_OK) rc = pagedrun_wait(c, out->request_id);
    else snprintf(out->error_message, sizeof out->error_message, "%s", c->err);
    c->has_cum = acc.has_cum; /* what pagedrun_cumulative_logprob reports from here on */
    c->cum = acc.cum;
    if (rc == PAGEDRUN_OK && acc.oom) rc = set_err(c, PAGEDRUN_E_NO_MEMORY, "out of memory");
    if (rc == PAGEDRUN_OK && !out->text) { /* empty completion */
        out->text = calloc(1, 1);
        if (!out->text) rc = PAGEDRUN_E_NO_MEMORY;
    }
    return rc;
}

int pagedrun_generate(pagedrun_client *c, const pagedrun_request *req, pagedrun_completion *out) {
    return pagedrun_generate_ext(c, req, NULL, out);
}

void pagedrun_completion_free(pagedrun_completion *o) {
    if (!o) return;
    free(o->text);
    free(o->token_ids);
    o->text = NULL;
    o->token_ids = NULL;
    o->text_len = o->n_tokens = 0;
}

/* ---- LoRA adapters (1.4) ----------------------------------------------------------------- */
/* LOAD_LORA (path set) / UNLOAD_LORA, waited for like a PING: LORA_REPLY or ERROR. */
static int lora_call(pagedrun_client *c, int type, const char *name, const char *path) {
    if (!c) return PAGEDRUN_E_INVALID_ARGUMENT;
    if (c->depth) return set_err(c, PAGEDRUN_E_INVALID_ARGUMENT, "not from a callback");
    int rc = check_text(c, "lora_name", name, 1, MAX_LORA_NAME_CHARS);
    if (rc == PAGEDRUN_OK && type == MSG_LOAD_LORA)
        rc = check_text(c, "lora_path", path, 1, MAX_LORA_PATH_CHARS);
    if (rc != PAGEDRUN_OK) return rc;
    char rid[32];
    snprintf(rid, sizeof rid, "_lr%llu", (unsigned long long)++c->seq);
    rpc_arm(c, MSG_LORA_REPLY, rid, 0);
    msgpack_packer pk;
    msgpack_sbuffer_clear(&c->sbuf);
    msgpack_packer_init(&pk, &c->sbuf, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, type == MSG_LOAD_LORA ? 3 : 2);
    pack_cstr(&pk, "request_id");
    pack_cstr(&pk, rid);
    pack_cstr(&pk, "lora_name");
    pack_cstr(&pk, name);
    if (type == MSG_LOAD_LORA) {
        pack_cstr(&pk, "lora_path");
        pack_cstr(&pk, path);
    }
    rc = send_frames(c, type);
    if (rc != PAGEDRUN_OK) return rc;
    c->rpc.active = 1;
    return rpc_wait(c);
}

int pagedrun_load_lora(pagedrun_client *c, const char *lora_name, const char *lora_path,
                       int64_t *lora_int_id_out) {
    int rc = lora_call(c, MSG_LOAD_LORA, lora_name, lora_path);
    if (rc == PAGEDRUN_OK && lora_int_id_out) *lora_int_id_out = c->rpc.lora_int_id;
    return rc;
}

int pagedrun_unload_lora(pagedrun_client *c, const char *lora_name, int *unloaded_out) {
    int rc = lora_call(c, MSG_UNLOAD_LORA, lora_name, NULL);
    if (rc == PAGEDRUN_OK && unloaded_out) *unloaded_out = !c->rpc.lora_loaded;
    return rc;
}
