/*
 * pagedrun_client.c: a plain-C client of the paged-run server (docs/protocol.md, version 1,
 * any 1.x revision), with libzmq and msgpack-c. It runs the two things every client needs:
 *   1. a streamed generation: GENERATE, then DELTA frames until FINAL;
 *   2. an abort: GENERATE, ABORT after the first DELTA, then ABORTED and FINAL("abort").
 * Reply fields are looked up by name (map_get), so fields this client does not know (minor
 * revisions add some) are skipped.
 *
 * usage: pagedrun_client ENDPOINT PROMPT [MAX_TOKENS [PROMPT_LOGPROBS]]
 * prints (one fact per line, for humans and for tests/server/test_c_client.py):
 *   TEXT <the streamed text>          TOKENS <id> <id> ...
 *   FINISH <finish_reason>            USAGE <prompt_tokens> <completion_tokens>
 *   ABORTED found=<0|1>               ABORT_FINISH <finish_reason>
 * and with PROMPT_LOGPROBS (k >= 0, asked for in the streamed generation; revision 1.1):
 *   PROMPT_LOGPROBS <frames that carried them> <entries>: <id or - (nil)> ...
 * exit status 0 when both exchanges went as the protocol says, 1 otherwise.
 */
#include <msgpack.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

enum { PROTOCOL_VERSION = 1 };
enum { MSG_GENERATE = 0x01, MSG_ABORT = 0x02, MSG_DELTA = 0x81, MSG_FINAL = 0x82,
       MSG_ABORTED = 0x83, MSG_ERROR = 0xFF };
enum { REPLY_TIMEOUT_MS = 30000, MAX_TOKENS_KEPT = 4096, ABORT_MAX_TOKENS = 100000 };

/* One received message: its type and its unpacked body (a msgpack map). */
typedef struct {
    int type;
    msgpack_unpacked body;
    char *raw;
} reply_t;

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

static int send_message(void *sock, int type, const msgpack_sbuffer *body) {
    unsigned char header[2] = {PROTOCOL_VERSION, (unsigned char)type};
    if (zmq_send(sock, header, sizeof header, ZMQ_SNDMORE) < 0) return -1;
    return zmq_send(sock, body->data, body->size, 0) < 0 ? -1 : 0;
}

/* prompt_logprobs < 0: not asked for. */
static int send_generate(void *sock, const char *request_id, const char *prompt, int max_tokens,
                         int prompt_logprobs) {
    msgpack_sbuffer sbuf;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sbuf);
    msgpack_packer_init(&pk, &sbuf, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 4);
    pack_str(&pk, "request_id"); pack_str(&pk, request_id);
    pack_str(&pk, "prompt");     pack_str(&pk, prompt);
    pack_str(&pk, "stream");     msgpack_pack_true(&pk);
    pack_str(&pk, "sampling_params");
    msgpack_pack_map(&pk, prompt_logprobs >= 0 ? 3 : 2);
    pack_str(&pk, "max_tokens");  msgpack_pack_int(&pk, max_tokens);
    pack_str(&pk, "temperature"); msgpack_pack_double(&pk, 0.0);
    if (prompt_logprobs >= 0) {
        pack_str(&pk, "prompt_logprobs"); msgpack_pack_int(&pk, prompt_logprobs);
    }
    int rc = send_message(sock, MSG_GENERATE, &sbuf);
    msgpack_sbuffer_destroy(&sbuf);
    return rc;
}

static int send_abort(void *sock, const char *request_id) {
    msgpack_sbuffer sbuf;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sbuf);
    msgpack_packer_init(&pk, &sbuf, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 1);
    pack_str(&pk, "request_id"); pack_str(&pk, request_id);
    int rc = send_message(sock, MSG_ABORT, &sbuf);
    msgpack_sbuffer_destroy(&sbuf);
    return rc;
}

/* Receives one two-frame message; 0 on success. */
static int recv_message(void *sock, reply_t *r) {
    zmq_msg_t header, body;
    zmq_msg_init(&header);
    if (zmq_msg_recv(&header, sock, 0) < 0) { zmq_msg_close(&header); return -1; }
    int ok = zmq_msg_size(&header) == 2 && zmq_msg_more(&header) &&
             ((unsigned char *)zmq_msg_data(&header))[0] == PROTOCOL_VERSION;
    r->type = ok ? ((unsigned char *)zmq_msg_data(&header))[1] : -1;
    zmq_msg_close(&header);
    if (!ok) return -1;
    zmq_msg_init(&body);
    if (zmq_msg_recv(&body, sock, 0) < 0) { zmq_msg_close(&body); return -1; }
    size_t n = zmq_msg_size(&body);
    r->raw = malloc(n ? n : 1);
    memcpy(r->raw, zmq_msg_data(&body), n);
    zmq_msg_close(&body);
    msgpack_unpacked_init(&r->body);
    size_t off = 0;
    if (msgpack_unpack_next(&r->body, r->raw, n, &off) != MSGPACK_UNPACK_SUCCESS ||
        r->body.data.type != MSGPACK_OBJECT_MAP) {
        msgpack_unpacked_destroy(&r->body);
        free(r->raw);
        return -1;
    }
    return 0;
}

static void reply_free(reply_t *r) {
    msgpack_unpacked_destroy(&r->body);
    free(r->raw);
}

/* The value of `key` in a msgpack map, or NULL. */
static const msgpack_object *map_get(const msgpack_object *map, const char *key) {
    size_t n = strlen(key);
    for (uint32_t i = 0; map->type == MSGPACK_OBJECT_MAP && i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            memcmp(k->via.str.ptr, key, n) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

static int str_equals(const msgpack_object *o, const char *s) {
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) &&
           memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

static void print_str(const char *prefix, const msgpack_object *o) {
    printf("%s%.*s\n", prefix, o && o->type == MSGPACK_OBJECT_STR ? (int)o->via.str.size : 0,
           o && o->type == MSGPACK_OBJECT_STR ? o->via.str.ptr : "");
}

static long as_long(const msgpack_object *o) {
    if (!o) return -1;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) return (long)o->via.u64;
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) return (long)o->via.i64;
    return -1;
}

static void print_error(const msgpack_object *body) {
    const msgpack_object *code = map_get(body, "code"), *msg = map_get(body, "message");
    fprintf(stderr, "server error [%.*s] %.*s\n",
            code && code->type == MSGPACK_OBJECT_STR ? (int)code->via.str.size : 0,
            code && code->type == MSGPACK_OBJECT_STR ? code->via.str.ptr : "",
            msg && msg->type == MSGPACK_OBJECT_STR ? (int)msg->via.str.size : 0,
            msg && msg->type == MSGPACK_OBJECT_STR ? msg->via.str.ptr : "");
}

/* Prompt logprobs (revision 1.1): an array of nil or {token_id, logprob, top}; keeps the ids. */
static int prompt_logprob_ids(const msgpack_object *arr, long *ids, int max_ids) {
    int n = 0;
    for (uint32_t i = 0; arr->type == MSGPACK_OBJECT_ARRAY && i < arr->via.array.size &&
                         n < max_ids; i++) {
        const msgpack_object *e = &arr->via.array.ptr[i];
        ids[n++] = e->type == MSGPACK_OBJECT_NIL ? -1 : as_long(map_get(e, "token_id"));
    }
    return n;
}

/* 1. Streamed generation: print the text as it arrives, then the token ids and the usage. */
static int streamed_generation(void *sock, const char *prompt, int max_tokens,
                               int prompt_logprobs) {
    if (send_generate(sock, "c-stream", prompt, max_tokens, prompt_logprobs) < 0) return -1;
    static long tokens[MAX_TOKENS_KEPT], prompt_ids[MAX_TOKENS_KEPT];
    int num_tokens = 0, num_prompt_ids = 0, prompt_lp_frames = 0, status = -1;
    fputs("TEXT ", stdout);
    for (;;) {
        reply_t r;
        if (recv_message(sock, &r) < 0) { fprintf(stderr, "no/bad reply\n"); return -1; }
        const msgpack_object *body = &r.body.data;
        if (r.type == MSG_DELTA) {
            const msgpack_object *text = map_get(body, "text"), *ids = map_get(body, "token_ids");
            if (text && text->type == MSGPACK_OBJECT_STR)
                fwrite(text->via.str.ptr, 1, text->via.str.size, stdout);
            for (uint32_t i = 0; ids && ids->type == MSGPACK_OBJECT_ARRAY &&
                                 i < ids->via.array.size && num_tokens < MAX_TOKENS_KEPT; i++)
                tokens[num_tokens++] = as_long(&ids->via.array.ptr[i]);
            const msgpack_object *plp = map_get(body, "prompt_logprobs");
            if (plp) {
                prompt_lp_frames++;
                num_prompt_ids = prompt_logprob_ids(plp, prompt_ids, MAX_TOKENS_KEPT);
            }
            fflush(stdout);
            reply_free(&r);
            continue;
        }
        putchar('\n');
        if (r.type == MSG_FINAL) {
            const msgpack_object *usage = map_get(body, "usage");
            fputs("TOKENS", stdout);
            for (int i = 0; i < num_tokens; i++) printf(" %ld", tokens[i]);
            putchar('\n');
            print_str("FINISH ", map_get(body, "finish_reason"));
            printf("USAGE %ld %ld\n", as_long(map_get(usage, "prompt_tokens")),
                   as_long(map_get(usage, "completion_tokens")));
            const msgpack_object *plp = map_get(body, "prompt_logprobs");
            if (plp) {
                prompt_lp_frames++;
                num_prompt_ids = prompt_logprob_ids(plp, prompt_ids, MAX_TOKENS_KEPT);
            }
            if (prompt_logprobs >= 0) {
                printf("PROMPT_LOGPROBS %d %d:", prompt_lp_frames, num_prompt_ids);
                for (int i = 0; i < num_prompt_ids; i++) {
                    if (prompt_ids[i] < 0) fputs(" -", stdout);
                    else printf(" %ld", prompt_ids[i]);
                }
                putchar('\n');
            }
            status = 0;
        } else if (r.type == MSG_ERROR) {
            print_error(body);
        }
        reply_free(&r);
        return status;
    }
}

/* 2. Abort: a long generation, ABORT after its first DELTA; expect ABORTED and FINAL "abort". */
static int aborted_generation(void *sock, const char *prompt) {
    if (send_generate(sock, "c-abort", prompt, ABORT_MAX_TOKENS, -1) < 0) return -1;
    int sent_abort = 0, got_ack = 0, got_final = 0, status = 0;
    while (!(got_ack && got_final)) {
        reply_t r;
        if (recv_message(sock, &r) < 0) { fprintf(stderr, "no/bad reply\n"); return -1; }
        const msgpack_object *body = &r.body.data;
        if (r.type == MSG_DELTA && !sent_abort) {
            if (send_abort(sock, "c-abort") < 0) status = -1;
            sent_abort = 1;
        } else if (r.type == MSG_ABORTED) {
            const msgpack_object *found = map_get(body, "found");
            int f = found && found->type == MSGPACK_OBJECT_BOOLEAN && found->via.boolean;
            printf("ABORTED found=%d\n", f);
            got_ack = 1;
        } else if (r.type == MSG_FINAL) {
            print_str("ABORT_FINISH ", map_get(body, "finish_reason"));
            if (!str_equals(map_get(body, "finish_reason"), "abort")) status = -1;
            got_final = 1;
        } else if (r.type == MSG_ERROR) {
            print_error(body);
            reply_free(&r);
            return -1;
        }
        reply_free(&r);
    }
    return status;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ENDPOINT PROMPT [MAX_TOKENS [PROMPT_LOGPROBS]]\n", argv[0]);
        return 2;
    }
    int max_tokens = argc > 3 ? atoi(argv[3]) : 32;
    int prompt_logprobs = argc > 4 ? atoi(argv[4]) : -1;
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_DEALER);
    int timeout_ms = REPLY_TIMEOUT_MS, linger_ms = 0;
    zmq_setsockopt(sock, ZMQ_RCVTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(sock, ZMQ_SNDTIMEO, &timeout_ms, sizeof timeout_ms);
    zmq_setsockopt(sock, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
    if (zmq_connect(sock, argv[1]) != 0) {
        fprintf(stderr, "connect %s: %s\n", argv[1], zmq_strerror(zmq_errno()));
        return 1;
    }
    int rc = streamed_generation(sock, argv[2], max_tokens, prompt_logprobs);
    if (rc == 0) rc = aborted_generation(sock, argv[2]);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return rc == 0 ? 0 : 1;
}
