/*
 * roundtrip.c: round-trip latency of 1-token requests through libpagedrun_client, for
 * benchmarks/bench_roundtrip.py. One client, one request at a time: pagedrun_generate (stream
 * off on the wire) with max_tokens = 1 and a short prompt; the time from the call to its return
 * (GENERATE sent, FINAL received and decoded) is one sample.
 *
 * usage: roundtrip ENDPOINT N [WARMUP [PROMPT]]
 * prints one line per measured request: the round trip in microseconds (after WARMUP unmeasured
 * ones); exit status 1 on any failed request.
 */
#define _POSIX_C_SOURCE 200809L
#include <pagedrun_client.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s ENDPOINT N [WARMUP [PROMPT]]\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[2]), warmup = argc > 3 ? atoi(argv[3]) : 200;
    const char *prompt = argc > 4 ? argv[4] : "ping";
    pagedrun_client *c = pagedrun_client_new(NULL);
    int rc = pagedrun_connect(c, argv[1]);
    if (rc != PAGEDRUN_OK) {
        fprintf(stderr, "connect: %s: %s\n", pagedrun_status_name(rc), pagedrun_last_error(c));
        return 1;
    }
    pagedrun_sampling sp;
    pagedrun_sampling_init(&sp);
    sp.max_tokens = 1;
    pagedrun_request req;
    pagedrun_request_init(&req);
    req.prompt = prompt;
    req.sampling = &sp;
    double *us = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int i = -warmup; i < n; i++) {
        pagedrun_completion comp;
        double t0 = now_us();
        rc = pagedrun_generate(c, &req, &comp);
        double t1 = now_us();
        if (rc != PAGEDRUN_OK || comp.n_tokens != 1) {
            fprintf(stderr, "request %d: %s: %s\n", i, pagedrun_status_name(rc),
                    pagedrun_last_error(c));
            return 1;
        }
        pagedrun_completion_free(&comp);
        if (i >= 0) us[i] = t1 - t0;
    }
    for (int i = 0; i < n; i++) printf("%.2f\n", us[i]);
    free(us);
    pagedrun_client_free(c);
    return 0;
}
