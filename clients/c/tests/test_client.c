/*
 * test_client.c: the C side of tests/server/test_c_library.py. Each scenario talks to a server
 * the Python test started and prints "KEY value" lines that the test checks; it exits 0 unless
 * a CHECK inside failed (the failed check is printed as "FAIL <line>: <expr>").
 *
 * The interactive scenarios (restart, hung) print STREAMING only once the library has returned
 * from the call that delivered the first DELTA: between that line and the next waiting call
 * nothing reads the socket, so whatever the test then does to the server (kill, SIGSTOP) can
 * only be seen by the waiting call that follows, never by a pump still running behind the
 * announcement. A request that ended before that point is reported as EARLY (and fails).
 *
 * usage: test_client ENDPOINT SCENARIO [ARGS...]
 *   api PROMPT MAX_TOKENS       streaming, blocking generate, concurrency, inputs, errors, ping
 *   abort PROMPT                abort by id, abort from a callback, abort of an unknown id
 *   timeout                     per-request timeout and deadline against a slow server
 *   restart PROMPT PING_TIMEOUT_S
 *                               stream; the test kills the server (STREAMING -> stdin line),
 *                               then restarts it on the same endpoint (second stdin line)
 *   hung PROMPT HEARTBEAT_S PING_TIMEOUT_S
 *                               stream; the test SIGSTOPs the server (STREAMING -> stdin line)
 *   down [PING_TIMEOUT_S CONNECT_TIMEOUT_S]
 *                               nothing listens at ENDPOINT (0.5 and 0.8 s if not given)
 *   lease PROMPT MAX_TOKENS HB  a long non-streamed generation; HB = heartbeat_s (0: auto)
 *   malformed VARIANT...        one request per variant against the test's garbage ROUTER
 *   curve SERVER_PUB PUB SEC    CURVE with these Z85 keys
 *   ext                         library 1.2 / protocol 1.3-1.4 request fields through
 *                               pagedrun_request_ext (chat options, lora_name) and their
 *                               client-side checks, against a server without LoRA
 *   lora ADAPTER_DIR            LOAD_LORA, generate under it, errors, UNLOAD_LORA (a server
 *                               with LoRA on and no tokenizer: token-id prompts)
 */
#define _POSIX_C_SOURCE 200809L
#include <pagedrun_client.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int failures = 0;
#define CHECK(expr)                                                                  \
    do {                                                                             \
        if (!(expr)) {                                                               \
            printf("FAIL %d: %s\n", __LINE__, #expr);                                \
            failures++;                                                              \
        }                                                                            \
    } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- a recording set of callbacks ------------------------------------------------------- */
typedef struct {
    char text[8192];
    size_t text_len;
    int32_t tokens[4096];
    size_t n_tokens;
    int n_deltas, n_prompt_lp, n_token_lp, abort_after; /* abort_after > 0: abort on that delta */
    char finish[32];
    pagedrun_usage usage;
    int finals, errors, error_status;
    char error_message[512];
    pagedrun_client *client; /* for aborting from a callback (and cumulative_logprob) */
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    /* protocol 1.3: per sampled-token entry "rank/n_top/top[0] id" and its decoded text;
     * per prompt entry its rank; per delta the cumulative_logprob ("-" when absent) */
    char ranks[2048], decoded[2048], prompt_ranks[2048], cums[2048];
    int abort_by_call; /* abort with pagedrun_abort(found = NULL) instead of the return value */
} rec;

static int rec_delta(const char *text, size_t len, const int32_t *ids, size_t n, void *user) {
    rec *r = user;
    if (r->text_len + len < sizeof r->text) {
        memcpy(r->text + r->text_len, text, len);
        r->text_len += len;
        r->text[r->text_len] = '\0';
    }
    for (size_t i = 0; i < n && r->n_tokens < 4096; i++) r->tokens[r->n_tokens++] = ids[i];
    r->n_deltas++;
    double cum;
    if (r->client && pagedrun_cumulative_logprob(r->client, &cum))
        snprintf(r->cums + strlen(r->cums), sizeof r->cums - strlen(r->cums), " %g", cum);
    else if (r->client)
        snprintf(r->cums + strlen(r->cums), sizeof r->cums - strlen(r->cums), " -");
    if (r->abort_after && r->n_deltas == r->abort_after) {
        if (!r->abort_by_call) return 1;
        CHECK(pagedrun_abort(r->client, r->rid, NULL) == PAGEDRUN_OK);
        int found;
        CHECK(pagedrun_abort(r->client, r->rid, &found) == PAGEDRUN_E_INVALID_ARGUMENT);
        CHECK(pagedrun_wait(r->client, r->rid) == PAGEDRUN_E_INVALID_ARGUMENT);
    }
    return 0;
}

static void rec_final(const char *reason, const pagedrun_usage *u, void *user) {
    rec *r = user;
    snprintf(r->finish, sizeof r->finish, "%s", reason);
    r->usage = *u;
    r->usage.stop_reason = NULL;
    r->finals++;
}

static void rec_error(int status, const char *message, void *user) {
    rec *r = user;
    r->errors++;
    r->error_status = status;
    snprintf(r->error_message, sizeof r->error_message, "%s", message);
}

static void rec_logprobs(const pagedrun_logprob *e, size_t n, int is_prompt, void *user) {
    rec *r = user;
    if (is_prompt) r->n_prompt_lp += (int)n;
    else r->n_token_lp += (int)n;
    for (size_t i = 0; i < n; i++) {
        char *dst = is_prompt ? r->prompt_ranks : r->ranks;
        size_t cap = is_prompt ? sizeof r->prompt_ranks : sizeof r->ranks, len = strlen(dst);
        if (e[i].token_id < 0) {
            snprintf(dst + len, cap - len, " -");
            continue;
        }
        if (is_prompt) {
            snprintf(dst + len, cap - len, " %lld", (long long)e[i].rank);
            continue;
        }
        snprintf(dst + len, cap - len, " %lld/%zu", (long long)e[i].rank, e[i].n_top);
        if (e[i].n_top) {
            len = strlen(dst);
            snprintf(dst + len, cap - len, "/%d", e[i].top_ids[0]);
            CHECK(e[i].rank < 0 || e[i].top_decoded_tokens[0] != NULL); /* 1.3 sends both */
        }
        len = strlen(r->decoded);
        snprintf(r->decoded + len, sizeof r->decoded - len, "%s",
                 e[i].decoded_token ? e[i].decoded_token : "?");
    }
}

static const pagedrun_callbacks REC_CB = {rec_delta, rec_final, rec_error, rec_logprobs};

static void print_tokens(const char *key, const int32_t *ids, size_t n) {
    printf("%s", key);
    for (size_t i = 0; i < n; i++) printf(" %d", ids[i]);
    printf("\n");
}

static pagedrun_client *connect_or_die(const char *ep, const pagedrun_options *o) {
    pagedrun_client *c = pagedrun_client_new(o);
    int rc = pagedrun_connect(c, ep);
    if (rc != PAGEDRUN_OK) {
        printf("FAIL connect: %s: %s\n", pagedrun_status_name(rc), pagedrun_last_error(c));
        exit(1);
    }
    return c;
}

static pagedrun_request make_req(const char *prompt, const pagedrun_sampling *sp) {
    pagedrun_request r;
    pagedrun_request_init(&r);
    r.prompt = prompt;
    r.sampling = sp;
    return r;
}

/* ---- scenarios --------------------------------------------------------------------------- */
static void scenario_api(const char *ep, const char *prompt, int max_tokens) {
    pagedrun_options o;
    pagedrun_options_init(&o);
    o.timeout_s = 20;
    pagedrun_client *c = connect_or_die(ep, &o);
    const pagedrun_server_info *info = pagedrun_get_server_info(c);
    printf("INFO model=%s max_model_len=%lld vocab=%lld lease=%g revision=%s server_id=%s\n",
           info->model, (long long)info->max_model_len, (long long)info->vocab_size,
           info->lease_s, info->protocol_revision, info->server_id);

    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = max_tokens;
    sp.temperature = 0;
    sp.prompt_logprobs = 2;
    sp.logprobs = 1;
    /* 1. streaming */
    rec s = {0};
    s.client = c;
    pagedrun_request req = make_req(prompt, &sp);
    CHECK(pagedrun_stream(c, &req, &REC_CB, &s) == PAGEDRUN_OK);
    print_tokens("STREAM_TOKENS", s.tokens, s.n_tokens);
    printf("STREAM_TEXT %s\n", s.text);
    printf("STREAM_FINISH %s\n", s.finish);
    printf("STREAM_DELTAS %d\n", s.n_deltas);
    printf("STREAM_USAGE %lld %lld\n", (long long)s.usage.prompt_tokens,
           (long long)s.usage.completion_tokens);
    printf("STREAM_LOGPROBS %d %d\n", s.n_prompt_lp, s.n_token_lp);
    printf("STREAM_RANKS%s\n", s.ranks);
    printf("STREAM_DECODED %s\n", s.decoded);
    printf("STREAM_PROMPT_RANKS%s\n", s.prompt_ranks);
    printf("STREAM_CUMS%s\n", s.cums);
    CHECK(s.finals == 1 && s.errors == 0);
    CHECK(s.usage.e2e_latency_s >= 0);

    /* 2. blocking generate (stream off on the wire) */
    pagedrun_sampling_init(&sp);
    sp.max_tokens = max_tokens;
    sp.logprobs = 0;
    pagedrun_completion comp;
    CHECK(pagedrun_generate(c, &req, &comp) == PAGEDRUN_OK);
    double gen_cum = 0;
    int has_gen_cum = pagedrun_cumulative_logprob(c, &gen_cum);
    printf("GEN_CUM %d %g\n", has_gen_cum, gen_cum);
    print_tokens("GEN_TOKENS", comp.token_ids, comp.n_tokens);
    printf("GEN_TEXT %s\n", comp.text);
    printf("GEN_FINISH %s\n", comp.finish_reason);
    CHECK(comp.text_len == strlen(comp.text) && comp.n_tokens == (size_t)max_tokens);
    pagedrun_completion_free(&comp);
    pagedrun_completion_free(&comp); /* idempotent */

    /* 3. concurrency: 4 streams on one connection, driven by pagedrun_poll */
    const char *prompts[4] = {"alpha", "bravo charlie", "delta echo foxtrot", "g"};
    rec rs[4];
    memset(rs, 0, sizeof rs);
    pagedrun_sampling sp4;
    pagedrun_sampling_init(&sp4);
    sp4.max_tokens = 7;
    for (int i = 0; i < 4; i++) {
        pagedrun_request r4 = make_req(prompts[i], &sp4);
        CHECK(pagedrun_submit(c, &r4, &REC_CB, &rs[i], rs[i].rid) == PAGEDRUN_OK);
    }
    CHECK(pagedrun_in_flight(c) == 4);
    double t0 = now_s();
    while (pagedrun_poll(c, 1000) > 0 && now_s() - t0 < 20) {
    }
    for (int i = 0; i < 4; i++) {
        char key[32];
        snprintf(key, sizeof key, "CONC_%d", i);
        print_tokens(key, rs[i].tokens, rs[i].n_tokens);
        CHECK(rs[i].finals == 1 && strcmp(rs[i].finish, "length") == 0);
    }
    CHECK(pagedrun_wait(c, rs[0].rid) == PAGEDRUN_E_NOT_FOUND);

    /* 4. the other prompt kinds, stop tokens, extra msgpack params */
    int32_t ids[3] = {72, 105, 33};
    pagedrun_request rt;
    pagedrun_request_init(&rt);
    rt.prompt_token_ids = ids;
    rt.n_prompt_token_ids = 3;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 5;
    rt.sampling = &sp;
    CHECK(pagedrun_generate(c, &rt, &comp) == PAGEDRUN_OK);
    print_tokens("IDS_TOKENS", comp.token_ids, comp.n_tokens);
    CHECK(pagedrun_cumulative_logprob(c, NULL) == 0); /* no logprobs asked: none */
    pagedrun_completion_free(&comp);

    pagedrun_chat_message msgs[2] = {{"system", "be brief"}, {"user", "hi"}};
    pagedrun_request rm;
    pagedrun_request_init(&rm);
    rm.messages = msgs;
    rm.n_messages = 2;
    rm.sampling = &sp;
    CHECK(pagedrun_generate(c, &rm, &comp) == PAGEDRUN_OK);
    print_tokens("CHAT_TOKENS", comp.token_ids, comp.n_tokens);
    pagedrun_completion_free(&comp);

    /* stop at the 3rd token of the reference (the test passes it as the stop id via argv) */
    /* extra_msgpack: {"ignore_eos": true, "seed": 7} */
    static const unsigned char extra[] = {0x82, 0xaa, 'i', 'g', 'n', 'o', 'r', 'e', '_', 'e',
                                          'o', 's', 0xc3, 0xa4, 's', 'e', 'e', 'd', 0x07};
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 4;
    sp.extra_msgpack = extra;
    sp.extra_msgpack_len = sizeof extra;
    const char *stops[1] = {"never-matches"};
    sp.stop = stops;
    sp.n_stop = 1;
    pagedrun_request rx = make_req(prompt, &sp);
    CHECK(pagedrun_generate(c, &rx, &comp) == PAGEDRUN_OK);
    printf("EXTRA_FINISH %s %zu\n", comp.finish_reason, comp.n_tokens);
    pagedrun_completion_free(&comp);
    static const unsigned char not_a_map[] = {0x92, 0x01, 0x02};
    sp.extra_msgpack = not_a_map;
    sp.extra_msgpack_len = sizeof not_a_map;
    CHECK(pagedrun_generate(c, &rx, &comp) == PAGEDRUN_E_INVALID_ARGUMENT);
    pagedrun_completion_free(&comp);
    static const unsigned char huge[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
    sp.extra_msgpack = huge;
    sp.extra_msgpack_len = sizeof huge;
    CHECK(pagedrun_generate(c, &rx, &comp) == PAGEDRUN_E_INVALID_ARGUMENT);
    pagedrun_completion_free(&comp);

    /* 5. server errors map to their own codes */
    pagedrun_sampling_init(&sp);
    sp.temperature = -1;
    pagedrun_request re = make_req(prompt, &sp);
    int rc = pagedrun_generate(c, &re, &comp);
    printf("ERR_INVALID %s %s\n", pagedrun_status_name(rc), comp.error_message);
    pagedrun_completion_free(&comp);
    re = make_req("", NULL);
    rc = pagedrun_generate(c, &re, &comp);
    printf("ERR_EMPTY %s\n", pagedrun_status_name(rc));
    pagedrun_completion_free(&comp);
    static char long_prompt[400];
    memset(long_prompt, 'x', sizeof long_prompt - 1);
    re = make_req(long_prompt, NULL);
    rc = pagedrun_generate(c, &re, &comp);
    printf("ERR_TOO_LONG %s\n", pagedrun_status_name(rc));
    pagedrun_completion_free(&comp);
    rec e = {0};
    re = make_req("x", NULL);
    rc = pagedrun_stream(c, &re, &REC_CB, &e);
    CHECK(rc == PAGEDRUN_OK); /* control */
    /* client-side argument checks */
    pagedrun_request bad;
    pagedrun_request_init(&bad);
    CHECK(pagedrun_submit(c, &bad, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    bad.prompt = "a";
    bad.n_messages = 1;
    bad.messages = msgs;
    CHECK(pagedrun_submit(c, &bad, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    /* duplicate id in flight: refused locally */
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 50;
    pagedrun_request rd = make_req("dup", &sp);
    rd.request_id = "same-id";
    rec d1 = {0}, d2 = {0};
    CHECK(pagedrun_submit(c, &rd, &REC_CB, &d1, NULL) == PAGEDRUN_OK);
    CHECK(pagedrun_submit(c, &rd, &REC_CB, &d2, NULL) == PAGEDRUN_E_DUPLICATE_REQUEST_ID);
    CHECK(pagedrun_wait(c, "same-id") == PAGEDRUN_OK && d1.finals == 1 && d2.finals == 0);

    /* 6. ping */
    pagedrun_pong pong;
    CHECK(pagedrun_ping(c, 5, &pong) == PAGEDRUN_OK);
    printf("PONG status=%s lease=%g rtt_ok=%d\n", pong.status, pong.lease_s,
           pong.round_trip_s > 0 && pong.round_trip_s < 5);

    /* 7. strerror / names */
    printf("NAMES %s %s %s %s %s\n", pagedrun_status_name(PAGEDRUN_E_CAPACITY),
           pagedrun_status_name(PAGEDRUN_E_TIMEOUT),
           pagedrun_status_name(PAGEDRUN_E_SERVER_UNAVAILABLE),
           pagedrun_status_name(PAGEDRUN_E_MALFORMED_REPLY),
           pagedrun_status_name(PAGEDRUN_E_CONNECTION));
    CHECK(pagedrun_status_from_code("overloaded") == PAGEDRUN_E_OVERLOADED);
    CHECK(pagedrun_status_from_code("brand_new_code") == PAGEDRUN_E_SERVER_ERROR);
    CHECK(strlen(pagedrun_strerror(PAGEDRUN_E_LEASE_EXPIRED)) > 0);
    CHECK(strcmp(pagedrun_strerror(12345), "unknown status") == 0);

    /* 8. disconnect ends what is in flight; connect again works */
    rec dd = {0};
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 200;
    pagedrun_request rdd = make_req("bye", &sp);
    CHECK(pagedrun_submit(c, &rdd, &REC_CB, &dd, NULL) == PAGEDRUN_OK);
    CHECK(pagedrun_disconnect(c) == PAGEDRUN_OK);
    CHECK(dd.errors == 1 && dd.error_status == PAGEDRUN_E_CONNECTION);
    CHECK(pagedrun_generate(c, &rdd, &comp) == PAGEDRUN_E_CONNECTION);
    pagedrun_completion_free(&comp);
    CHECK(pagedrun_reconnect(c) == PAGEDRUN_OK);
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 2;
    CHECK(pagedrun_generate(c, &rdd, &comp) == PAGEDRUN_OK);
    pagedrun_completion_free(&comp);
    pagedrun_client_free(c);
    pagedrun_client_free(NULL);
}

static void scenario_abort(const char *ep, const char *prompt) {
    pagedrun_client *c = connect_or_die(ep, NULL);
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 200;
    /* a. by id, from outside: submit, poll until the first delta, pagedrun_abort */
    rec a = {0};
    pagedrun_request r = make_req(prompt, &sp);
    r.request_id = "abort-by-id";
    CHECK(pagedrun_submit(c, &r, &REC_CB, &a, a.rid) == PAGEDRUN_OK);
    while (a.n_deltas == 0 && pagedrun_poll(c, 5000) > 0) {
    }
    int found = -1;
    CHECK(pagedrun_abort(c, "abort-by-id", &found) == PAGEDRUN_OK);
    int rc = pagedrun_wait(c, "abort-by-id");
    CHECK(rc == PAGEDRUN_OK || rc == PAGEDRUN_E_NOT_FOUND);
    printf("ABORT_ID found=%d finish=%s finals=%d deltas_lt_200=%d\n", found, a.finish, a.finals,
           (int)(a.n_tokens < 200));
    /* b. from a callback, by return value */
    rec b = {0};
    b.abort_after = 2;
    r.request_id = "abort-by-return";
    CHECK(pagedrun_stream(c, &r, &REC_CB, &b) == PAGEDRUN_OK);
    printf("ABORT_RETURN finish=%s finals=%d\n", b.finish, b.finals);
    /* c. from a callback, by pagedrun_abort(found = NULL) */
    rec d = {0};
    d.abort_after = 3;
    d.abort_by_call = 1;
    d.client = c;
    snprintf(d.rid, sizeof d.rid, "abort-by-call");
    r.request_id = "abort-by-call";
    CHECK(pagedrun_stream(c, &r, &REC_CB, &d) == PAGEDRUN_OK);
    printf("ABORT_CALL finish=%s finals=%d\n", d.finish, d.finals);
    /* d. an id that is not in flight */
    CHECK(pagedrun_abort(c, "never-sent", &found) == PAGEDRUN_OK);
    printf("ABORT_UNKNOWN found=%d\n", found);
    pagedrun_client_free(c);
}

static void scenario_timeout(const char *ep) {
    pagedrun_client *c = connect_or_die(ep, NULL);
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 50;
    /* the server takes 1 s per token: nothing arrives within 0.3 s */
    pagedrun_request r = make_req("slow", &sp);
    r.timeout_s = 0.3;
    rec a = {0};
    double t0 = now_s();
    int rc = pagedrun_stream(c, &r, &REC_CB, &a);
    printf("TIMEOUT %s %.3f errors=%d\n", pagedrun_status_name(rc), now_s() - t0, a.errors);
    /* a deadline for the whole request */
    r.timeout_s = 0;
    r.deadline_s = 0.5;
    pagedrun_completion comp;
    t0 = now_s();
    rc = pagedrun_generate(c, &r, &comp);
    printf("DEADLINE %s %.3f\n", pagedrun_status_name(rc), now_s() - t0);
    pagedrun_completion_free(&comp);
    /* the server is fine: a ping still works (the timed-out requests were aborted) */
    CHECK(pagedrun_ping(c, 5, NULL) == PAGEDRUN_OK);
    pagedrun_client_free(c);
}

static void wait_stdin_line(void) {
    char line[64];
    if (!fgets(line, sizeof line, stdin)) exit(3);
}

/* Polls until request `a` delivered its first DELTA, then, with the library returned (nothing
 * reads the socket until the next waiting call), prints STREAMING for the test to act on. 0 if
 * the request ended before that (its outcome is printed as EARLY and counted as a failure): it
 * must end because of what the test does next, not before. */
static int announce_streaming(pagedrun_client *c, const rec *a) {
    double t0 = now_s();
    while (a->n_deltas == 0 && a->finals + a->errors == 0 && now_s() - t0 < 30) {
        if (pagedrun_poll(c, 1000) < 0) break;
    }
    if (a->n_deltas == 0 || a->finals + a->errors != 0) {
        printf("EARLY deltas=%d finals=%d errors=%d status=%s message=%s\n", a->n_deltas,
               a->finals, a->errors, a->errors ? pagedrun_status_name(a->error_status) : "-",
               a->error_message);
        failures++;
        return 0;
    }
    printf("STREAMING\n");
    fflush(stdout);
    return 1;
}

static void scenario_restart(const char *ep, const char *prompt, double ping_timeout_s) {
    pagedrun_options o;
    pagedrun_options_init(&o);
    o.timeout_s = 30;
    o.ping_timeout_s = ping_timeout_s;
    pagedrun_client *c = connect_or_die(ep, &o);
    char first_instance[PAGEDRUN_REQUEST_ID_BUF];
    snprintf(first_instance, sizeof first_instance, "%s", pagedrun_get_server_info(c)->server_id);
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 200;
    pagedrun_request r = make_req(prompt, &sp);
    rec a = {0};
    double t0 = 0;
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    CHECK(pagedrun_submit(c, &r, &REC_CB, &a, rid) == PAGEDRUN_OK);
    if (!announce_streaming(c, &a)) {
        pagedrun_client_free(c);
        return;
    }
    wait_stdin_line(); /* the test killed the server */
    t0 = now_s();
    int rc = pagedrun_wait(c, rid);
    printf("LOST %s %.3f\n", pagedrun_status_name(rc), now_s() - t0);
    printf("LOST_MESSAGE %s\n", a.error_message);
    /* it ended in this wait, through on_error, with the status the wait returned */
    CHECK(a.errors == 1 && a.finals == 0 && a.error_status == rc);
    /* nothing listens now: a new request fails fast as well */
    pagedrun_completion comp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 3;
    t0 = now_s();
    rc = pagedrun_generate(c, &r, &comp);
    printf("WHILE_DOWN %s %.3f\n", pagedrun_status_name(rc), now_s() - t0);
    pagedrun_completion_free(&comp);
    printf("DOWN_READY\n");
    fflush(stdout);
    wait_stdin_line(); /* the test started a new server on the same endpoint */
    /* the socket reconnects by itself */
    rc = pagedrun_generate(c, &r, &comp);
    printf("AFTER %s %zu %s\n", pagedrun_status_name(rc), comp.n_tokens, comp.finish_reason);
    pagedrun_completion_free(&comp);
    /* and an explicit reconnect works too (fresh socket, MODEL_INFO again) */
    CHECK(pagedrun_reconnect(c) == PAGEDRUN_OK);
    const char *second = pagedrun_get_server_info(c)->server_id;
    printf("INSTANCES %s %s changed=%d\n", first_instance[0] ? first_instance : "-",
           second[0] ? second : "-", strcmp(first_instance, second) != 0);
    rc = pagedrun_generate(c, &r, &comp);
    printf("RECONNECTED %s %zu\n", pagedrun_status_name(rc), comp.n_tokens);
    pagedrun_completion_free(&comp);
    pagedrun_client_free(c);
}

static void scenario_hung(const char *ep, const char *prompt, double heartbeat_s,
                          double ping_timeout_s) {
    pagedrun_options o;
    pagedrun_options_init(&o);
    o.timeout_s = 30;
    o.heartbeat_s = heartbeat_s;
    o.ping_timeout_s = ping_timeout_s;
    pagedrun_client *c = connect_or_die(ep, &o);
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 200;
    pagedrun_request r = make_req(prompt, &sp);
    rec a = {0};
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    CHECK(pagedrun_submit(c, &r, &REC_CB, &a, rid) == PAGEDRUN_OK);
    if (!announce_streaming(c, &a)) {
        pagedrun_client_free(c);
        return;
    }
    wait_stdin_line(); /* the test stopped the server (SIGSTOP) */
    double t0 = now_s();
    int rc = pagedrun_wait(c, rid);
    printf("HUNG %s %.3f\n", pagedrun_status_name(rc), now_s() - t0);
    printf("HUNG_MESSAGE %s\n", a.error_message);
    CHECK(a.errors == 1 && a.finals == 0 && a.error_status == rc);
    pagedrun_client_free(c);
}

static void scenario_down(const char *ep, double ping_timeout_s, double connect_timeout_s) {
    pagedrun_options o;
    pagedrun_options_init(&o);
    o.ping_timeout_s = ping_timeout_s;
    o.connect_timeout_s = connect_timeout_s;
    pagedrun_client *c = pagedrun_client_new(&o);
    double t0 = now_s();
    int rc = pagedrun_connect(c, ep);
    printf("CONNECT %s %.3f\n", pagedrun_status_name(rc), now_s() - t0);
    /* connect_timeout_s, not ping_timeout_s (the test passes a shorter ping timeout) */
    CHECK(now_s() - t0 >= connect_timeout_s * 0.95);
    /* connecting without waiting, then a request: also server_unavailable, not the timeout */
    o.connect_timeout_s = 0;
    pagedrun_client *c2 = pagedrun_client_new(&o);
    CHECK(pagedrun_connect(c2, ep) == PAGEDRUN_OK);
    pagedrun_completion comp;
    pagedrun_request r = make_req("anyone?", NULL);
    t0 = now_s();
    rc = pagedrun_generate(c2, &r, &comp);
    printf("GENERATE %s %.3f\n", pagedrun_status_name(rc), now_s() - t0);
    pagedrun_completion_free(&comp);
    pagedrun_client *c3 = pagedrun_client_new(NULL);
    rc = pagedrun_connect(c3, "nonsense://x");
    printf("BAD_ENDPOINT %s\n", pagedrun_status_name(rc));
    pagedrun_client_free(c3);
    pagedrun_client_free(c2);
    pagedrun_client_free(c);
}

static void scenario_lease(const char *ep, const char *prompt, int max_tokens, double hb) {
    pagedrun_options o;
    pagedrun_options_init(&o);
    o.timeout_s = 30;
    o.heartbeat_s = hb;
    pagedrun_client *c = connect_or_die(ep, &o);
    printf("LEASE %g\n", pagedrun_get_server_info(c)->lease_s);
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = max_tokens;
    pagedrun_request r = make_req(prompt, &sp);
    pagedrun_completion comp;
    double t0 = now_s();
    int rc = pagedrun_generate(c, &r, &comp);
    printf("RESULT %s %zu %.3f\n", pagedrun_status_name(rc), comp.n_tokens, now_s() - t0);
    printf("MESSAGE %s\n", comp.error_message);
    pagedrun_completion_free(&comp);
    pagedrun_client_free(c);
}

static void scenario_malformed(const char *ep, int n, char **variants) {
    pagedrun_options o;
    pagedrun_options_init(&o);
    o.timeout_s = 10; /* the test wants every variant to end long before this */
    pagedrun_client *c = connect_or_die(ep, &o);
    for (int i = 0; i < n; i++) {
        rec a = {0};
        pagedrun_request r = make_req("garbage please", NULL);
        r.request_id = variants[i];
        double t0 = now_s();
        int rc = pagedrun_stream(c, &r, &REC_CB, &a);
        printf("VARIANT %s %s %.3f\n", variants[i], pagedrun_status_name(rc), now_s() - t0);
        CHECK(a.finals + a.errors == 1);
        CHECK(pagedrun_in_flight(c) == 0);
    }
    /* LORA_REPLY (1.4): the garbage server answers LOAD_LORA with a string lora_int_id */
    int64_t id = -1;
    int rc = pagedrun_load_lora(c, "a", "/p", &id);
    printf("LORA_REPLY_BAD %s\n", pagedrun_status_name(rc));
    CHECK(id == -1);
    int unloaded = -1;
    rc = pagedrun_unload_lora(c, "a", &unloaded);
    printf("LORA_REPLY_OK %s %d\n", pagedrun_status_name(rc), unloaded);
    pagedrun_client_free(c);
}

static void scenario_curve(const char *ep, const char *server_pub, const char *pub,
                           const char *sec) {
    pagedrun_options o;
    pagedrun_options_init(&o);
    o.server_public_key = server_pub;
    o.client_public_key = pub;
    o.client_secret_key = sec;
    o.connect_timeout_s = 10; /* a refused key must fail long before this */
    pagedrun_client *c = pagedrun_client_new(&o);
    double t0 = now_s();
    int rc = pagedrun_connect(c, ep);
    printf("CURVE_CONNECT %s %.3f\n", pagedrun_status_name(rc), now_s() - t0);
    if (rc == PAGEDRUN_OK) {
        pagedrun_completion comp;
        pagedrun_request r = make_req("secret", NULL);
        rc = pagedrun_generate(c, &r, &comp);
        printf("CURVE_GENERATE %s %zu\n", pagedrun_status_name(rc), comp.n_tokens);
        pagedrun_completion_free(&comp);
    } else {
        printf("CURVE_MESSAGE %s\n", pagedrun_last_error(c));
    }
    pagedrun_client_free(c);
}

/* ---- library 1.2: pagedrun_request_ext, LoRA --------------------------------------------- */
/* One blocking chat generation with ext; prints "KEY status prompt_tokens token ids..." and,
 * on failure, "KEY_MESSAGE <pagedrun_last_error>". */
static int chat_case(pagedrun_client *c, const char *key, const pagedrun_request *req,
                     const pagedrun_request_ext *ext) {
    pagedrun_completion comp;
    int rc = pagedrun_generate_ext(c, req, ext, &comp);
    printf("%s %s %lld", key, pagedrun_status_name(rc), (long long)comp.usage.prompt_tokens);
    for (size_t i = 0; i < comp.n_tokens; i++) printf(" %d", comp.token_ids[i]);
    printf("\n");
    if (rc != PAGEDRUN_OK) printf("%s_MESSAGE %s\n", key, pagedrun_last_error(c));
    pagedrun_completion_free(&comp);
    return rc;
}

static void scenario_ext(const char *ep) {
    pagedrun_client *c = connect_or_die(ep, NULL);
    printf("EXT_INFO enable_lora=%d\n", pagedrun_get_server_info(c)->enable_lora);
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 4;
    pagedrun_chat_message msgs[2] = {{"user", "hi"}, {"assistant", "Hel"}};
    pagedrun_request req;
    pagedrun_request_init(&req);
    req.messages = msgs;
    req.n_messages = 2;
    req.sampling = &sp;
    pagedrun_request_ext ext;
    /* the chat options, each as the Python client sends it (the test compares) */
    chat_case(c, "CHAT_DEFAULT", &req, NULL);
    pagedrun_request_ext_init(&ext);
    CHECK(ext.struct_size == sizeof ext && ext.add_generation_prompt == -1 && !ext.lora_name);
    chat_case(c, "CHAT_EXT_UNSET", &req, &ext);
    ext.add_generation_prompt = 0;
    chat_case(c, "CHAT_NO_GEN_PROMPT", &req, &ext);
    pagedrun_request_ext_init(&ext);
    ext.chat_template = "{{ messages }} custom";
    ext.add_generation_prompt = 1;
    chat_case(c, "CHAT_TEMPLATE", &req, &ext);
    /* tools: [{"name": "f"}], chat_template_kwargs: {"lang": "fr"} */
    static const unsigned char tools[] = {0x91, 0x81, 0xa4, 'n', 'a', 'm', 'e', 0xa1, 'f'};
    static const unsigned char kwargs[] = {0x81, 0xa4, 'l', 'a', 'n', 'g', 0xa2, 'f', 'r'};
    pagedrun_request_ext_init(&ext);
    ext.tools_msgpack = tools;
    ext.tools_msgpack_len = sizeof tools;
    ext.chat_template_kwargs_msgpack = kwargs;
    ext.chat_template_kwargs_msgpack_len = sizeof kwargs;
    chat_case(c, "CHAT_TOOLS_KWARGS", &req, &ext);
    pagedrun_request_ext_init(&ext);
    ext.continue_final_message = 1;
    ext.add_generation_prompt = 0;
    chat_case(c, "CHAT_CONTINUE", &req, &ext);
    ext.add_generation_prompt = 1; /* the server refuses the pair */
    chat_case(c, "CHAT_BOTH", &req, &ext);
    /* streamed, through pagedrun_stream_ext */
    pagedrun_request_ext_init(&ext);
    ext.chat_template = "{{ messages }} custom";
    rec st = {0};
    CHECK(pagedrun_stream_ext(c, &req, &ext, &REC_CB, &st) == PAGEDRUN_OK);
    printf("CHAT_STREAM %lld", (long long)st.usage.prompt_tokens);
    print_tokens("", st.tokens, st.n_tokens);

    /* lora_name is sent: this server has LoRA off and says so */
    pagedrun_request_ext_init(&ext);
    ext.lora_name = "some-adapter";
    chat_case(c, "LORA_OFF", &req, &ext);
    int64_t id = -1;
    int rc = pagedrun_load_lora(c, "some-adapter", "/nonexistent", &id);
    printf("LOAD_OFF %s %lld\n", pagedrun_status_name(rc), (long long)id);
    printf("LOAD_OFF_MESSAGE %s\n", pagedrun_last_error(c));
    int unloaded = -1;
    rc = pagedrun_unload_lora(c, "some-adapter", &unloaded);
    printf("UNLOAD_OFF %s %d\n", pagedrun_status_name(rc), unloaded);

    /* client-side checks: PAGEDRUN_E_INVALID_ARGUMENT with a message, nothing sent */
    pagedrun_request plain = make_req("plain prompt", &sp);
    pagedrun_request_ext_init(&ext);
    ext.add_generation_prompt = 0;
    CHECK(pagedrun_submit_ext(c, &plain, &ext, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    printf("ARG_CHAT_WITHOUT_MESSAGES %s\n", pagedrun_last_error(c));
    ext.add_generation_prompt = 2;
    CHECK(pagedrun_generate_ext(c, &req, &ext, &(pagedrun_completion){0}) ==
          PAGEDRUN_E_INVALID_ARGUMENT);
    printf("ARG_BOOL %s\n", pagedrun_last_error(c));
    pagedrun_request_ext_init(&ext);
    ext.tools_msgpack = kwargs; /* a map, not an array */
    ext.tools_msgpack_len = sizeof kwargs;
    CHECK(pagedrun_submit_ext(c, &req, &ext, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    printf("ARG_TOOLS %s\n", pagedrun_last_error(c));
    static unsigned char many[3 + 65 * 3];
    size_t n = 0;
    many[n++] = 0xde; /* map16 of 65 entries "A".."A"+64 -> 0 */
    many[n++] = 0;
    many[n++] = 65;
    for (int i = 0; i < 65; i++) {
        many[n++] = 0xa1;
        many[n++] = (unsigned char)('A' + i);
        many[n++] = 0;
    }
    pagedrun_request_ext_init(&ext);
    ext.chat_template_kwargs_msgpack = many;
    ext.chat_template_kwargs_msgpack_len = n;
    CHECK(pagedrun_submit_ext(c, &req, &ext, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    printf("ARG_KWARGS %s\n", pagedrun_last_error(c));
    ext.chat_template_kwargs_msgpack_len = n - 1; /* truncated */
    CHECK(pagedrun_submit_ext(c, &req, &ext, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    pagedrun_request_ext_init(&ext);
    ext.lora_name = "";
    CHECK(pagedrun_submit_ext(c, &req, &ext, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    printf("ARG_LORA_EMPTY %s\n", pagedrun_last_error(c));
    static char long_name[130];
    memset(long_name, 'n', 129);
    ext.lora_name = long_name;
    CHECK(pagedrun_submit_ext(c, &req, &ext, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    CHECK(pagedrun_load_lora(c, long_name, "/x", NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    CHECK(pagedrun_load_lora(c, "x", NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    CHECK(pagedrun_unload_lora(c, "", NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    long_name[128] = '\0'; /* 128 characters: allowed (and unknown to the server) */
    CHECK(pagedrun_submit_ext(c, &req, &ext, NULL, NULL, NULL) == PAGEDRUN_OK);
    for (int i = 0; i < 50 && pagedrun_in_flight(c) > 0; i++) CHECK(pagedrun_poll(c, 200) >= 0);
    /* struct_size: unset is refused; a smaller one hides the later fields; a larger one (a
     * program built against a later header) is fine while the unknown bytes are zero */
    pagedrun_request_ext_init(&ext);
    ext.struct_size = 0;
    CHECK(pagedrun_submit_ext(c, &req, &ext, NULL, NULL, NULL) == PAGEDRUN_E_INVALID_ARGUMENT);
    printf("ARG_SIZE0 %s\n", pagedrun_last_error(c));
    pagedrun_request_ext_init(&ext);
    ext.struct_size = offsetof(pagedrun_request_ext, chat_template);
    ext.chat_template = "ignored: past struct_size";
    CHECK(chat_case(c, "EXT_SMALL", &plain, &ext) == PAGEDRUN_OK);
    struct {
        pagedrun_request_ext ext;
        int64_t later_field;
    } big;
    memset(&big, 0, sizeof big);
    pagedrun_request_ext_init(&big.ext);
    big.ext.struct_size = sizeof big;
    big.ext.add_generation_prompt = 0;
    chat_case(c, "EXT_BIG_ZERO", &req, &big.ext);
    big.later_field = 1;
    CHECK(pagedrun_submit_ext(c, &req, &big.ext, NULL, NULL, NULL) ==
          PAGEDRUN_E_INVALID_ARGUMENT);
    printf("ARG_SIZE_BIG %s\n", pagedrun_last_error(c));
    CHECK(pagedrun_in_flight(c) == 0);
    pagedrun_client_free(c);
}

static void scenario_lora(const char *ep, const char *adapter_dir) {
    pagedrun_client *c = connect_or_die(ep, NULL);
    printf("LORA_INFO enable_lora=%d\n", pagedrun_get_server_info(c)->enable_lora);
    int64_t id = -1, id2 = -1;
    CHECK(pagedrun_load_lora(c, "c-adapter", adapter_dir, &id) == PAGEDRUN_OK);
    CHECK(pagedrun_load_lora(c, "c-adapter", adapter_dir, &id2) == PAGEDRUN_OK); /* again */
    printf("LOADED %lld %lld\n", (long long)id, (long long)id2);
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 5;
    sp.temperature = 0;
    sp.ignore_eos = 1;
    int32_t ids[6] = {5, 9, 17, 33, 2, 8};
    pagedrun_request req;
    pagedrun_request_init(&req);
    req.prompt_token_ids = ids;
    req.n_prompt_token_ids = 6;
    req.sampling = &sp;
    pagedrun_request_ext ext;
    pagedrun_request_ext_init(&ext);
    ext.lora_name = "c-adapter";
    chat_case(c, "LORA_GEN", &req, &ext);
    chat_case(c, "BASE_GEN", &req, NULL);
    rec st = {0};
    CHECK(pagedrun_stream_ext(c, &req, &ext, &REC_CB, &st) == PAGEDRUN_OK);
    print_tokens("LORA_STREAM", st.tokens, st.n_tokens);
    ext.lora_name = "nope";
    chat_case(c, "LORA_UNKNOWN", &req, &ext);
    int rc = pagedrun_load_lora(c, "c-adapter", "/elsewhere/adapter", NULL);
    printf("LOAD_OTHER_PATH %s\n", pagedrun_status_name(rc));
    printf("LOAD_OTHER_PATH_MESSAGE %s\n", pagedrun_last_error(c));
    rc = pagedrun_load_lora(c, "broken", "/nonexistent/adapter", NULL);
    printf("LOAD_BAD_DIR %s\n", pagedrun_status_name(rc));
    int unloaded = -1;
    CHECK(pagedrun_unload_lora(c, "c-adapter", &unloaded) == PAGEDRUN_OK);
    printf("UNLOADED %d\n", unloaded);
    ext.lora_name = "c-adapter";
    chat_case(c, "LORA_AFTER_UNLOAD", &req, &ext);
    rc = pagedrun_unload_lora(c, "c-adapter", &unloaded);
    printf("UNLOAD_AGAIN %s\n", pagedrun_status_name(rc));
    CHECK(pagedrun_ping(c, 5, NULL) == PAGEDRUN_OK); /* the client goes on */
    pagedrun_client_free(c);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 3) {
        fprintf(stderr, "usage: %s ENDPOINT SCENARIO [ARGS...]\n", argv[0]);
        return 2;
    }
    const char *ep = argv[1], *sc = argv[2];
    if (!strcmp(sc, "api") && argc == 5) scenario_api(ep, argv[3], atoi(argv[4]));
    else if (!strcmp(sc, "abort") && argc == 4) scenario_abort(ep, argv[3]);
    else if (!strcmp(sc, "timeout")) scenario_timeout(ep);
    else if (!strcmp(sc, "restart") && argc == 5) scenario_restart(ep, argv[3], atof(argv[4]));
    else if (!strcmp(sc, "hung") && argc == 6)
        scenario_hung(ep, argv[3], atof(argv[4]), atof(argv[5]));
    else if (!strcmp(sc, "down") && argc == 3) scenario_down(ep, 0.5, 0.8);
    else if (!strcmp(sc, "down") && argc == 5) scenario_down(ep, atof(argv[3]), atof(argv[4]));
    else if (!strcmp(sc, "lease") && argc == 6)
        scenario_lease(ep, argv[3], atoi(argv[4]), atof(argv[5]));
    else if (!strcmp(sc, "malformed")) scenario_malformed(ep, argc - 3, argv + 3);
    else if (!strcmp(sc, "curve") && argc == 6) scenario_curve(ep, argv[3], argv[4], argv[5]);
    else if (!strcmp(sc, "ext") && argc == 3) scenario_ext(ep);
    else if (!strcmp(sc, "lora") && argc == 4) scenario_lora(ep, argv[3]);
    else {
        fprintf(stderr, "unknown scenario or arguments\n");
        return 2;
    }
    printf("DONE failures=%d\n", failures);
    return failures ? 1 : 0;
}
