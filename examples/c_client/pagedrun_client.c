/*
 * pagedrun_client.c: a small example program on top of libpagedrun_client (clients/c; the
 * library speaks docs/protocol.md). It runs the two things every client needs:
 *   1. a streamed generation: pagedrun_stream, printing DELTA text as it arrives;
 *   2. an abort: a long generation, pagedrun_abort after the first DELTA, then ABORTED and the
 *      stream's FINAL("abort").
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
#include <pagedrun_client.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_TOKENS_KEPT = 4096, ABORT_MAX_TOKENS = 100000 };
#define REPLY_TIMEOUT_S 30.0

/* 1. Streamed generation */
typedef struct {
    long tokens[MAX_TOKENS_KEPT], prompt_ids[MAX_TOKENS_KEPT];
    int num_tokens, num_prompt_ids, prompt_lp_frames;
    char finish[32];
    long prompt_tokens, completion_tokens;
} stream_state;

static int on_delta(const char *text, size_t text_len, const int32_t *ids, size_t n,
                    void *user) {
    stream_state *s = user;
    fwrite(text, 1, text_len, stdout);
    fflush(stdout);
    for (size_t i = 0; i < n && s->num_tokens < MAX_TOKENS_KEPT; i++)
        s->tokens[s->num_tokens++] = ids[i];
    return 0; /* keep going */
}

static void on_logprobs(const pagedrun_logprob *e, size_t n, int is_prompt, void *user) {
    stream_state *s = user;
    if (!is_prompt) return;
    s->prompt_lp_frames++;
    s->num_prompt_ids = 0;
    for (size_t i = 0; i < n && s->num_prompt_ids < MAX_TOKENS_KEPT; i++)
        s->prompt_ids[s->num_prompt_ids++] = e[i].token_id; /* -1: nil (prompt token 0) */
}

static void on_final(const char *finish_reason, const pagedrun_usage *u, void *user) {
    stream_state *s = user;
    snprintf(s->finish, sizeof s->finish, "%s", finish_reason);
    s->prompt_tokens = (long)u->prompt_tokens;
    s->completion_tokens = (long)u->completion_tokens;
}

static void on_error(int status, const char *message, void *user) {
    (void)user;
    fprintf(stderr, "\nerror %s: %s\n", pagedrun_status_name(status), message);
}

static int streamed_generation(pagedrun_client *c, const char *prompt, int max_tokens,
                               int prompt_logprobs) {
    static stream_state s;
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = max_tokens;
    sp.temperature = 0.0;
    if (prompt_logprobs >= 0) sp.prompt_logprobs = prompt_logprobs;
    pagedrun_request req;
    pagedrun_request_init(&req);
    req.request_id = "c-stream";
    req.prompt = prompt;
    req.sampling = &sp;
    pagedrun_callbacks cb = {on_delta, on_final, on_error, on_logprobs};
    fputs("TEXT ", stdout);
    int rc = pagedrun_stream(c, &req, &cb, &s);
    putchar('\n');
    if (rc != PAGEDRUN_OK) return -1;
    fputs("TOKENS", stdout);
    for (int i = 0; i < s.num_tokens; i++) printf(" %ld", s.tokens[i]);
    putchar('\n');
    printf("FINISH %s\n", s.finish);
    printf("USAGE %ld %ld\n", s.prompt_tokens, s.completion_tokens);
    if (prompt_logprobs >= 0) {
        printf("PROMPT_LOGPROBS %d %d:", s.prompt_lp_frames, s.num_prompt_ids);
        for (int i = 0; i < s.num_prompt_ids; i++) {
            if (s.prompt_ids[i] < 0) fputs(" -", stdout);
            else printf(" %ld", s.prompt_ids[i]);
        }
        putchar('\n');
    }
    return 0;
}

/* 2. Abort: a long generation, ABORT after its first DELTA; expect ABORTED and FINAL "abort". */
typedef struct {
    int got_delta;
    char finish[32];
} abort_state;

static int abort_on_delta(const char *text, size_t len, const int32_t *ids, size_t n,
                          void *user) {
    (void)text, (void)len, (void)ids, (void)n;
    ((abort_state *)user)->got_delta = 1;
    return 0;
}

static void abort_on_final(const char *finish_reason, const pagedrun_usage *u, void *user) {
    (void)u;
    snprintf(((abort_state *)user)->finish, sizeof ((abort_state *)user)->finish, "%s",
             finish_reason);
}

static int aborted_generation(pagedrun_client *c, const char *prompt) {
    abort_state s = {0, ""};
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = ABORT_MAX_TOKENS;
    sp.temperature = 0.0;
    pagedrun_request req;
    pagedrun_request_init(&req);
    req.request_id = "c-abort";
    req.prompt = prompt;
    req.sampling = &sp;
    pagedrun_callbacks cb = {abort_on_delta, abort_on_final, on_error, NULL};
    char rid[PAGEDRUN_REQUEST_ID_BUF];
    if (pagedrun_submit(c, &req, &cb, &s, rid) != PAGEDRUN_OK) return -1;
    while (!s.got_delta) { /* wait for its first DELTA */
        int n = pagedrun_poll(c, -1);
        if (n <= 0) return -1; /* failed, or ended before any DELTA */
    }
    int found = 0;
    if (pagedrun_abort(c, rid, &found) != PAGEDRUN_OK) {
        fprintf(stderr, "abort: %s\n", pagedrun_last_error(c));
        return -1;
    }
    printf("ABORTED found=%d\n", found);
    int rc = pagedrun_wait(c, rid); /* its FINAL (NOT_FOUND: it came while aborting) */
    if (rc != PAGEDRUN_OK && rc != PAGEDRUN_E_NOT_FOUND) return -1;
    printf("ABORT_FINISH %s\n", s.finish);
    return strcmp(s.finish, "abort") == 0 ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ENDPOINT PROMPT [MAX_TOKENS [PROMPT_LOGPROBS]]\n", argv[0]);
        return 2;
    }
    int max_tokens = argc > 3 ? atoi(argv[3]) : 32;
    int prompt_logprobs = argc > 4 ? atoi(argv[4]) : -1;
    pagedrun_options opts;
    pagedrun_options_init(&opts);
    opts.timeout_s = REPLY_TIMEOUT_S;
    pagedrun_client *c = pagedrun_client_new(&opts);
    if (!c) return 1;
    int rc = pagedrun_connect(c, argv[1]);
    if (rc != PAGEDRUN_OK) {
        fprintf(stderr, "connect %s: %s: %s\n", argv[1], pagedrun_status_name(rc),
                pagedrun_last_error(c));
        pagedrun_client_free(c);
        return 1;
    }
    rc = streamed_generation(c, argv[2], max_tokens, prompt_logprobs);
    if (rc == 0) rc = aborted_generation(c, argv[2]);
    pagedrun_client_free(c);
    return rc == 0 ? 0 : 1;
}
