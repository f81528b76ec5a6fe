/* The agent's frames out: each capture into a track's audio source requested here and its answer taken here
(by the callback, audio_pump.c `pump_event`), with no Python in between.

`pump_capture` copies the samples (resampled to the track's rate first when the source was opened with
another rate, resample.c) and makes the runtime's capture request with an async id of this library's; the
runtime reads the copy until its callback, which `capture_done` takes: the copy is freed and the answer
counted (done, an error, a slow one). A capture never answered gives its entry up once every entry is taken
and it is older than `reclaim_s`. A track's counters are read by Python (agent/audio_pump.py
`TrackCapture`). */

#include "pump.h"
#include "resample.h"

#include <stdlib.h>
#include <string.h>

/* a track's captures, in the order pump_capture_stats writes them */
enum { C_SENT, C_DONE, C_ERRORS, C_SLOW, C_REFUSED, N_CSTATS };

/* -- the agent's frames out: captures into a track's audio source ---------------------------------- */

#define MAX_CAPTURES 1024 /* in flight at once, all tracks of the process */
#define MAX_SOURCES 4096

typedef struct {
    uint64_t id; /* 0: free */
    uint64_t source;
    int16_t *samples; /* our copy: the runtime reads it until its callback */
    double sent;
} capture_t;

typedef struct {
    uint64_t source; /* 0: free */
    double slow_s;
    double stats[N_CSTATS];
    resampler *rs; /* the frames' rate to the track's, or NULL: they come at the track's rate */
} source_t;

static capture_t captures[MAX_CAPTURES];
static source_t sources[MAX_SOURCES];
static int n_sources;
static uint64_t next_capture_id = (uint64_t)1 << 60; /* apart from the ids the SDK's own requests get */
/* a capture still unanswered this long after it was made (its source closed under it, a runtime that lost it)
   gives its entry up to a new one when every entry is taken: the runtime is long done reading its copy */
static double reclaim_s = 30.0;

static source_t *find_source(uint64_t handle) {
    for (int i = 0; i < n_sources; i++)
        if (sources[i].source == handle) return &sources[i];
    return NULL;
}

static size_t put_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    do {
        uint8_t b = v & 0x7f;
        v >>= 7;
        p[n++] = b | (v ? 0x80 : 0);
    } while (v);
    return n;
}

/* A varint field (wire type 0), and a field of bytes (wire type 2): its length, then the bytes. */
static size_t put_uint(uint8_t *p, int field, uint64_t v) {
    size_t n = put_varint(p, (uint64_t)field << 3);
    return n + put_varint(p + n, v);
}

static size_t put_bytes(uint8_t *p, int field, const uint8_t *bytes, size_t len) {
    size_t n = put_varint(p, ((uint64_t)field << 3) | 2);
    n += put_varint(p + n, len);
    memcpy(p + n, bytes, len);
    return n + len;
}

/* A capture's callback: its copy is freed and its track's counters move. 0: not one of ours. */
int capture_done(const uint8_t *cb, size_t cb_n) {
    const uint8_t *p, *end, *sub;
    size_t sublen;
    uint32_t num;
    uint64_t val, id = 0;
    int error = 0;
    p = cb, end = cb + cb_n;
    while (p < end) {
        if (!next_field(&p, end, &num, &val, &sub, &sublen)) return 0;
        if ((int)num == fields[F_CB_ASYNC] && sub == NULL) id = val;
        else if ((int)num == fields[F_CB_ERROR] && sub != NULL && sublen > 0) error = 1;
    }
    if (id == 0) return 0;
    int16_t *samples = NULL;
    int found = 0;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < MAX_CAPTURES; i++) {
        if (captures[i].id != id) continue;
        source_t *src = find_source(captures[i].source);
        if (src != NULL) {
            src->stats[C_DONE] += 1;
            if (error) src->stats[C_ERRORS] += 1;
            if (now_s() - captures[i].sent > src->slow_s) src->stats[C_SLOW] += 1;
        }
        samples = captures[i].samples;
        memset(&captures[i], 0, sizeof captures[i]);
        found = 1;
        break;
    }
    pthread_mutex_unlock(&mu);
    free(samples);
    return found; /* another's (the SDK's own AudioSource): Python's */
}

/* A track's audio source whose frames this file captures; `slow_s`: a capture its runtime takes longer than
   this to answer is counted slow. Frames at `in_rate` are resampled to `track_rate` (the source's) before
   they are captured; the same rate twice (or 0): none is. A source's captures and its close come from one
   thread (its room's loop). */
int pump_source_open(uint64_t handle, double slow_s, int in_rate, int track_rate) {
    resampler *rs = NULL;
    if (in_rate > 0 && track_rate > 0 && in_rate != track_rate && (rs = rs_new(in_rate, track_rate)) == NULL)
        return -1;
    int rc = -1;
    pthread_mutex_lock(&mu);
    source_t *src = find_source(handle);
    if (src == NULL) src = find_source(0);
    if (src == NULL && n_sources < MAX_SOURCES) src = &sources[n_sources++];
    if (src != NULL && src->source != handle) {
        memset(src, 0, sizeof *src);
        src->source = handle;
        src->slow_s = slow_s;
        src->rs = rs;
        rs = NULL;
        rc = 0;
    }
    pthread_mutex_unlock(&mu);
    rs_free(rs);
    return rc;
}

int pump_source_close(uint64_t handle) {
    resampler *rs = NULL;
    pthread_mutex_lock(&mu);
    source_t *src = find_source(handle);
    if (src != NULL) {
        rs = src->rs;
        memset(src, 0, sizeof *src);
    }
    while (n_sources > 0 && sources[n_sources - 1].source == 0) n_sources--;
    pthread_mutex_unlock(&mu);
    rs_free(rs);
    return src != NULL ? 0 : -1;
}

/* One frame of int16 mono samples at `rate` into the source's queue (resampled first when `rate` is the one
   its source was opened to resample from): the runtime's capture request, made here, its callback taken by
   `pump_event`. Returns the captures of this source still unanswered (this one included), 0 when the
   resampler has no whole sample to give yet, or -1 when it was refused (an unknown source, too many in
   flight, no memory) and counted. */
int pump_capture(uint64_t source, const int16_t *samples, uint32_t n, uint32_t rate) {
    if (ffi_request == NULL || n == 0 || rate == 0) return -1;
    pthread_mutex_lock(&mu);
    source_t *found = find_source(source);
    resampler *rs = found != NULL ? found->rs : NULL; /* only this thread uses or frees it (pump_source_open) */
    pthread_mutex_unlock(&mu);
    int16_t *copy;
    if (rs != NULL && rate == (uint32_t)rs_in_rate(rs)) {
        int64_t out_n = rs_out_len(rs, n);
        if ((copy = malloc((size_t)(out_n > 0 ? out_n : 1) * sizeof(int16_t))) == NULL) return -1;
        int64_t made = rs_run(rs, samples, n, copy);
        if (made <= 0) { /* no memory (-1), or no whole sample yet (0) */
            free(copy);
            return made < 0 ? -1 : 0;
        }
        n = (uint32_t)out_n, rate = (uint32_t)rs_out_rate(rs);
    } else {
        if ((copy = malloc((size_t)n * sizeof(int16_t))) == NULL) return -1;
        memcpy(copy, samples, (size_t)n * sizeof(int16_t));
    }
    int slot = -1, pending = 0;
    uint64_t id = 0;
    pthread_mutex_lock(&mu);
    source_t *src = find_source(source);
    if (src != NULL) {
        int oldest = -1;
        for (int i = 0; i < MAX_CAPTURES; i++) {
            if (captures[i].id == 0 && slot < 0) slot = i;
            else if (captures[i].id != 0 && captures[i].source == source) pending++;
            if (captures[i].id != 0 && (oldest < 0 || captures[i].sent < captures[oldest].sent)) oldest = i;
        }
        if (slot < 0 && oldest >= 0 && now_s() - captures[oldest].sent > reclaim_s) {
            source_t *was = find_source(captures[oldest].source);
            if (was != NULL) was->stats[C_ERRORS] += 1; /* never answered */
            free(captures[oldest].samples);
            memset(&captures[oldest], 0, sizeof captures[oldest]);
            slot = oldest;
        }
        if (slot < 0) {
            src->stats[C_REFUSED] += 1;
        } else {
            id = next_capture_id++;
            captures[slot] = (capture_t){id, source, copy, now_s()};
            src->stats[C_SENT] += 1;
        }
    }
    pthread_mutex_unlock(&mu);
    if (slot < 0) {
        free(copy);
        return -1;
    }
    /* FfiRequest { capture_audio_frame { source_handle, buffer { data_ptr, num_channels, sample_rate,
       samples_per_channel }, request_async_id } } */
    uint8_t info[64], body[128], req[160];
    size_t ni = 0, nb = 0;
    ni += put_uint(info + ni, fields[F_INFO_PTR], (uint64_t)(uintptr_t)copy);
    ni += put_uint(info + ni, fields[F_INFO_CH], 1);
    ni += put_uint(info + ni, fields[F_INFO_RATE], rate);
    ni += put_uint(info + ni, fields[F_INFO_SPC], n);
    nb += put_uint(body + nb, fields[F_CAP_SOURCE], source);
    nb += put_bytes(body + nb, fields[F_CAP_BUFFER], info, ni);
    nb += put_uint(body + nb, fields[F_CAP_ASYNC], id);
    size_t nr = put_bytes(req, fields[F_REQ_CAPTURE], body, nb);
    const uint8_t *res = NULL;
    size_t res_n = 0;
    uint64_t handle = ffi_request(req, nr, &res, &res_n);
    /* the answer names the callback's id: the one asked for, or (a runtime that ignores it) its own */
    const uint8_t *r, *p, *end, *sub;
    size_t r_n, sublen;
    uint32_t num;
    uint64_t val, got = id;
    if (res != NULL && find_bytes(res, res_n, fields[F_RESP_CAPTURE], &r, &r_n)) {
        p = r, end = r + r_n;
        while (p < end && next_field(&p, end, &num, &val, &sub, &sublen))
            if ((int)num == fields[F_RESP_ASYNC] && sub == NULL) got = val;
    }
    if (handle != 0 && drop_handle != NULL) drop_handle(handle);
    if (got != id) { /* its callback carries the runtime's id: none of ours, so it would never be freed */
        pthread_mutex_lock(&mu);
        if (captures[slot].id == id) captures[slot].id = got;
        pthread_mutex_unlock(&mu);
    }
    return pending + 1;
}

void pump_set_reclaim(double seconds) {
    pthread_mutex_lock(&mu);
    reclaim_s = seconds;
    pthread_mutex_unlock(&mu);
}

int pump_max_captures(void) { return MAX_CAPTURES; }

int pump_capture_stats(uint64_t source, double *out, int n) {
    int rc = -1;
    pthread_mutex_lock(&mu);
    source_t *src = find_source(source);
    if (src != NULL && n >= N_CSTATS) {
        memcpy(out, src->stats, sizeof src->stats);
        rc = 0;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

