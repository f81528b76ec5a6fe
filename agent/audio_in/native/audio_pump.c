/* The caller's audio and the rtc runtime with no Python in between: the caller's frames straight into the
engine's ring.

The livekit rtc SDK's native library hands every event to one callback (livekit_ffi_initialize). This file is
that callback. For an audio stream registered here (one per caller track, made by agent/audio_pump.py), a
received piece of audio is parsed from its protobuf event, its samples are cut into the engine's input frames
and written into the session's shared memory (engine/link.py: the caller ring, its write times and counter),
and the piece's native buffer is dropped at once. A capture's answer is taken by capture.c (the agent's frames
out). Every other event goes to the SDK's own Python callback, unchanged and in order, but for a batch of log
records that callback would only throw away (`quiet_logs`).

Before its session's ring is attached a stream's frames are held (bounded; the oldest are dropped and counted)
and written, in order, when it is.

Once attached, a stream keeps its frames' ends just ahead of the engine's ticks (`align`). The runtime hands
the caller's audio over in 10 ms pieces, and where the 80 ms frames are cut among them is this file's
choice: cut where the stream happened to start, a room's frames would wait for the tick anything up to a
whole tick, a different wait in every room. Each whole frame's lead (how long before the next tick it is
written, from the engine's last take, engine/link.py `taken_at`) is measured; once ALIGN_FRAMES frames in a
row have led by more than the lead asked for (`lead_s`) plus a piece, and steadily (within ALIGN_STEADY_S),
whole pieces of that excess are left out of the frames, only quiet ones (below the loud threshold): every
later frame ends that much later, as close behind its tick as the lead asked for allows. Nothing the caller
says is left out; the pieces left out are counted (`aligned`).

A stream's counters (frames, written, ring full, held, held dropped, bad, the time of the last loud frame,
aligned) are read by Python; nothing here logs. The event's field numbers come from the SDK's own
descriptors at `pump_init` (pump.h), so nothing here is tied to one protobuf schema's numbering; the wire
format is protobuf's. */

#include "pump.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef void (*event_cb)(const uint8_t *data, size_t len);


/* a stream's counters, in the order pump_stats writes them */
enum { S_FRAMES, S_WRITTEN, S_RING_FULL, S_HELD, S_HELD_DROPPED, S_BAD, S_VOICED_AT, S_ALIGNED, N_STATS };
/* the process's, in the order pump_totals writes them */
enum { T_CONSUMED, T_FORWARDED, T_LATE, T_STREAMS, T_QUIET_LOGS, T_EARLY, N_TOTALS };

#define MAX_STREAMS 4096
#define TOMBSTONES 256 /* streams closed lately: a frame of theirs still in flight is dropped, not forwarded */
#define ALIGN_FRAMES 6      /* frames whose leads are measured before the frames' cut moves (480 ms) */
#define ALIGN_STEADY_S 0.004 /* ... and that lead within this of each other */
#define ALIGN_STALE_TICKS 4 /* an engine that has not taken frames for this many ticks is not timed against */

typedef struct {
    uint64_t handle; /* the stream's FFI handle; 0: a free entry */
    int rate, frame; /* the engine's input rate and frame (samples) */
    double loud;     /* a frame is loud above this sum of squares */
    /* the session's ring, or NULL while none is attached (frames are held) */
    volatile int64_t *in_w, *in_r;
    int16_t *frames;
    double *stamps;
    int64_t nframes, w;
    int16_t *pend; /* samples of a frame not yet whole */
    int npend;
    int16_t *hold; /* held frames, a ring of hold_cap */
    int hold_cap, hold_head, hold_n;
    /* aligning the frames' ends with the ticks: the engine's last take, the tick, the lead asked for (0: off),
       the last frames' leads, the samples still to leave out of quiet pieces, the last piece's samples */
    volatile double *taken_at;
    double tick_s, lead_s;
    double leads[ALIGN_FRAMES];
    int nleads, drop, piece;
    double stats[N_STATS];
} stream_t;

static event_cb forward;
drop_fn drop_handle;
request_fn ffi_request;
int fields[N_FIELDS];
static stream_t streams[MAX_STREAMS];
static int n_streams; /* entries in use are below this index */
static uint64_t tombstones[TOMBSTONES];
static int tomb_next;
static uint64_t totals[N_TOTALS];
/* streams being opened (`pump_opening`), and the highest handle registered: a piece of a stream newer than
   every registered one while one is being opened is the new stream's, come before its registration */
static int opening;
static uint64_t newest;
pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* -- protobuf's wire format: just enough to walk a message ------------------------------------------- */

static int varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t x = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = x;
            return 1;
        }
    }
    return 0;
}

int next_field(const uint8_t **p, const uint8_t *end, uint32_t *num, uint64_t *val, const uint8_t **sub,
               size_t *sublen) {
    uint64_t key, len;
    if (*p >= end || !varint(p, end, &key)) return 0;
    *num = (uint32_t)(key >> 3);
    *sub = NULL;
    switch (key & 7) {
    case 0:
        return varint(p, end, val);
    case 1:
        if (end - *p < 8) return 0;
        *p += 8;
        return 1;
    case 2:
        if (!varint(p, end, &len) || len > (uint64_t)(end - *p)) return 0;
        *sub = *p;
        *sublen = (size_t)len;
        *p += len;
        return 1;
    case 5:
        if (end - *p < 4) return 0;
        *p += 4;
        return 1;
    default:
        return 0;
    }
}

#define ANY_FIELD (-1)

/* The last length-delimited field numbered `want` (any, with ANY_FIELD) of a message's `n` bytes: its bytes,
   and its number where `num_out` is given; 0 for none, or for a malformed message. */
static int last_field(const uint8_t *p, size_t n, int want, int *num_out, const uint8_t **out, size_t *outlen) {
    const uint8_t *end = p + n, *sub;
    size_t sublen;
    uint32_t num;
    uint64_t val;
    int found = 0;
    while (p < end) {
        if (!next_field(&p, end, &num, &val, &sub, &sublen)) return 0;
        if (sub != NULL && (want == ANY_FIELD || (int)num == want)) {
            *out = sub;
            *outlen = sublen;
            if (num_out != NULL) *num_out = (int)num;
            found = 1;
        }
    }
    return found;
}

int find_bytes(const uint8_t *p, size_t n, int want, const uint8_t **out, size_t *outlen) {
    return last_field(p, n, want, NULL, out, outlen);
}

typedef struct {
    uint64_t stream, buffer, data;
    uint32_t channels, rate, samples;
} frame_event;

/* An audio stream event (`ase`, the event's AudioStreamEvent) that is a received frame; 0 for another. */
static int parse_frame(const uint8_t *ase, size_t ase_n, frame_event *ev) {
    const uint8_t *afr, *buf, *p, *end, *sub;
    size_t afr_n = 0, buf_n, sublen;
    uint32_t num;
    uint64_t val;
    int has_stream = 0;
    memset(ev, 0, sizeof *ev);
    p = ase, end = ase + ase_n;
    afr = NULL;
    while (p < end) {
        if (!next_field(&p, end, &num, &val, &sub, &sublen)) return 0;
        if ((int)num == fields[F_ASE_HANDLE] && sub == NULL) {
            ev->stream = val;
            has_stream = 1;
        } else if ((int)num == fields[F_ASE_FRAME] && sub != NULL) {
            afr = sub;
            afr_n = sublen;
        }
    }
    if (!has_stream || afr == NULL) return 0;
    if (!find_bytes(afr, afr_n, fields[F_AFR_FRAME], &buf, &buf_n)) return 0;
    p = buf, end = buf + buf_n;
    while (p < end) {
        if (!next_field(&p, end, &num, &val, &sub, &sublen)) return 0;
        if (sub == NULL) continue;
        const uint8_t *q = sub, *qend = sub + sublen, *s2;
        size_t s2len;
        uint32_t n2;
        uint64_t v2;
        if ((int)num == fields[F_BUF_HANDLE]) {
            while (q < qend) {
                if (!next_field(&q, qend, &n2, &v2, &s2, &s2len)) return 0;
                if ((int)n2 == fields[F_HANDLE_ID] && s2 == NULL) ev->buffer = v2;
            }
        } else if ((int)num == fields[F_BUF_INFO]) {
            while (q < qend) {
                if (!next_field(&q, qend, &n2, &v2, &s2, &s2len)) return 0;
                if (s2 != NULL) continue;
                if ((int)n2 == fields[F_INFO_PTR]) ev->data = v2;
                else if ((int)n2 == fields[F_INFO_CH]) ev->channels = (uint32_t)v2;
                else if ((int)n2 == fields[F_INFO_RATE]) ev->rate = (uint32_t)v2;
                else if ((int)n2 == fields[F_INFO_SPC]) ev->samples = (uint32_t)v2;
            }
        }
    }
    return 1;
}

/* A batch of the runtime's log records that the SDK's Python callback would only throw away: each record is
   a trace, or a debug record of the runtime's own (target "libwebrtc" or "livekit...") while
   LIVEKIT_RTC_DEBUG is off (livekit/rtc/_ffi_client.py ffi_event_callback). A batch with any other record
   goes to Python whole. */
static int quiet_logs(const uint8_t *batch, size_t batch_n) {
    const uint8_t *p, *end, *rec, *sub;
    size_t rec_n, sublen;
    uint32_t num;
    uint64_t val;
    int records = 0;
    p = batch, end = batch + batch_n;
    while (p < end) {
        if (!next_field(&p, end, &num, &val, &rec, &rec_n)) return 0;
        if ((int)num != fields[F_LB_RECORDS] || rec == NULL) continue;
        uint64_t level = 0; /* protobuf's default: the enum's first value, LOG_ERROR */
        const uint8_t *target = NULL, *q = rec, *qend = rec + rec_n;
        size_t target_n = 0;
        while (q < qend) {
            if (!next_field(&q, qend, &num, &val, &sub, &sublen)) return 0;
            if ((int)num == fields[F_LR_LEVEL] && sub == NULL) level = val;
            else if ((int)num == fields[F_LR_TARGET] && sub != NULL) target = sub, target_n = sublen;
        }
        int runtime = target != NULL && ((target_n == 9 && memcmp(target, "libwebrtc", 9) == 0) ||
                                         (target_n >= 7 && memcmp(target, "livekit", 7) == 0));
        int thrown = level == (uint64_t)fields[V_LOG_TRACE] ||
                     (level == (uint64_t)fields[V_LOG_DEBUG] && runtime && !fields[V_RTC_DEBUG]);
        if (!thrown) return 0;
        records++;
    }
    return records > 0;
}

/* -- streams ----------------------------------------------------------------------------------------- */

static stream_t *find(uint64_t handle) {
    for (int i = 0; i < n_streams; i++)
        if (streams[i].handle == handle) return &streams[i];
    return NULL;
}

static int is_tombstone(uint64_t handle) {
    for (int i = 0; i < TOMBSTONES; i++)
        if (tombstones[i] == handle) return 1;
    return 0;
}

/* One whole frame into the ring; counted as ring full when the engine has not taken the ring's worth. */
static void write_ring(stream_t *s, const int16_t *frame) {
    int64_t r = __atomic_load_n(s->in_r, __ATOMIC_ACQUIRE);
    if (s->w - r >= s->nframes) {
        s->stats[S_RING_FULL] += 1;
        return;
    }
    int64_t i = s->w % s->nframes;
    memcpy(s->frames + i * s->frame, frame, (size_t)s->frame * sizeof(int16_t));
    s->stamps[i] = now_s();
    s->w += 1;
    __atomic_store_n(s->in_w, s->w, __ATOMIC_RELEASE);
    s->stats[S_WRITTEN] += 1;
}

static void hold(stream_t *s, const int16_t *frame) {
    if (s->hold_n == s->hold_cap) { /* the oldest goes */
        s->hold_head = (s->hold_head + 1) % s->hold_cap;
        s->hold_n -= 1;
        s->stats[S_HELD_DROPPED] += 1;
    }
    int at = (s->hold_head + s->hold_n) % s->hold_cap;
    memcpy(s->hold + (size_t)at * s->frame, frame, (size_t)s->frame * sizeof(int16_t));
    s->hold_n += 1;
    s->stats[S_HELD] += 1;
}

static double energy(const int16_t *x, int n) {
    double e = 0.0;
    for (int i = 0; i < n; i++) e += (double)x[i] * (double)x[i];
    return e;
}

/* A frame was just written: its lead on the next tick joins the last ones; after ALIGN_FRAMES of them, the
   quiet samples to leave out (whole pieces of the steady excess over the lead asked for), or none. */
static void align(stream_t *s) {
    if (s->lead_s <= 0.0 || s->taken_at == NULL || s->piece <= 0) return;
    double taken = *s->taken_at, since = now_s() - taken;
    if (taken <= 0.0 || since < 0.0 || since > ALIGN_STALE_TICKS * s->tick_s) {
        s->nleads = 0, s->drop = 0; /* no ticks to time against */
        return;
    }
    s->leads[s->nleads++] = s->tick_s - fmod(since, s->tick_s);
    if (s->nleads < ALIGN_FRAMES) return;
    s->nleads = 0;
    double lo = s->leads[0], hi = s->leads[0];
    for (int i = 1; i < ALIGN_FRAMES; i++) {
        if (s->leads[i] < lo) lo = s->leads[i];
        if (s->leads[i] > hi) hi = s->leads[i];
    }
    double piece_s = (double)s->piece / s->rate;
    int pieces = hi - lo <= ALIGN_STEADY_S ? (int)floor((lo - s->lead_s) / piece_s) : 0;
    s->drop = pieces > 0 ? pieces * s->piece : 0;
}

static void whole_frame(stream_t *s, const int16_t *frame) {
    if (energy(frame, s->frame) > s->loud) s->stats[S_VOICED_AT] = now_s();
    s->stats[S_FRAMES] += 1;
    if (s->frames != NULL) {
        write_ring(s, frame);
        align(s);
    } else {
        hold(s, frame);
    }
}

static void take(stream_t *s, const frame_event *ev) {
    if (ev->data == 0 || ev->channels != 1 || (int)ev->rate != s->rate || ev->samples == 0 ||
        ev->samples > (uint32_t)(s->rate * 10)) {
        s->stats[S_BAD] += 1;
        return;
    }
    const int16_t *src = (const int16_t *)(uintptr_t)ev->data;
    int n = (int)ev->samples;
    s->piece = n;
    if (s->drop > 0 && s->frames != NULL && energy(src, n) * s->frame <= s->loud * n) {
        int k = n < s->drop ? n : s->drop; /* a quiet piece: left out, so the frames end later */
        src += k;
        n -= k;
        s->drop -= k;
        s->stats[S_ALIGNED] += k;
    }
    if (s->npend == 0) { /* whole frames straight from the buffer: the usual case */
        while (n >= s->frame) {
            whole_frame(s, src);
            src += s->frame;
            n -= s->frame;
        }
    }
    while (n > 0) {
        int k = s->frame - s->npend < n ? s->frame - s->npend : n;
        memcpy(s->pend + s->npend, src, (size_t)k * sizeof(int16_t));
        s->npend += k;
        src += k;
        n -= k;
        if (s->npend == s->frame) {
            whole_frame(s, s->pend);
            s->npend = 0;
        }
    }
}

/* -- the callback ------------------------------------------------------------------------------------ */

/* The event's message (an FfiEvent is one field of a oneof): its number and bytes; 0 for none. */
static int event_message(const uint8_t *data, size_t len, int *which, const uint8_t **msg, size_t *msg_n) {
    return last_field(data, len, ANY_FIELD, which, msg, msg_n);
}

void pump_event(const uint8_t *data, size_t len) {
    frame_event ev;
    const uint8_t *msg = NULL;
    size_t msg_n = 0;
    int which = -1;
    if (!event_message(data, len, &which, &msg, &msg_n)) which = -1;
    if (which == fields[F_EVENT_AUDIO] && parse_frame(msg, msg_n, &ev) && ev.buffer != 0) {
        int mine = 0;
        pthread_mutex_lock(&mu);
        stream_t *s = find(ev.stream);
        if (s != NULL) {
            take(s, &ev);
            mine = 1;
            totals[T_CONSUMED] += 1;
        } else if (is_tombstone(ev.stream)) {
            mine = 1;
            totals[T_LATE] += 1;
        } else if (opening > 0 && ev.stream > newest) {
            mine = 1; /* the first piece of a stream not registered yet: dropped, never to Python */
            totals[T_EARLY] += 1;
        }
        pthread_mutex_unlock(&mu);
        if (mine) {
            if (drop_handle != NULL) drop_handle(ev.buffer);
            return;
        }
    }
    if (which == fields[F_EVENT_CAPTURE] && capture_done(msg, msg_n)) return;
    if (which == fields[F_EVENT_LOGS] && quiet_logs(msg, msg_n)) {
        __atomic_add_fetch(&totals[T_QUIET_LOGS], 1, __ATOMIC_RELAXED);
        return;
    }
    __atomic_add_fetch(&totals[T_FORWARDED], 1, __ATOMIC_RELAXED);
    if (forward != NULL) forward(data, len);
}

/* -- what Python calls ------------------------------------------------------------------------------- */

int pump_init(event_cb fwd, drop_fn drop, request_fn request, const int32_t *numbers, int n) {
    if (n != N_FIELDS) return -1;
    pthread_mutex_lock(&mu);
    forward = fwd;
    drop_handle = drop;
    ffi_request = request;
    for (int i = 0; i < N_FIELDS; i++) fields[i] = numbers[i];
    pthread_mutex_unlock(&mu);
    return 0;
}

/* A stream is being opened (+1) or is registered or failed (-1): until it is, a piece of a stream newer than
   every registered one is its first, and is dropped (counted as early) rather than reaching Python, which
   has no stream to take it. */
void pump_opening(int delta) {
    pthread_mutex_lock(&mu);
    opening += delta;
    pthread_mutex_unlock(&mu);
}

/* A stream whose frames are the engine's: `rate` Hz mono cut into `frame` samples, a frame loud above
   `loud_ms` mean square, up to `hold_frames` held until a ring is attached. -1: no room, or bad arguments. */
int pump_register(uint64_t handle, int rate, int frame, double loud_ms, int hold_frames) {
    if (handle == 0 || rate <= 0 || frame <= 0 || hold_frames <= 0) return -1;
    int16_t *pend = calloc((size_t)frame, sizeof(int16_t));
    int16_t *held = calloc((size_t)frame * (size_t)hold_frames, sizeof(int16_t));
    if (pend == NULL || held == NULL) {
        free(pend);
        free(held);
        return -1;
    }
    pthread_mutex_lock(&mu);
    stream_t *s = find(handle);
    if (s == NULL) s = find(0);
    if (s == NULL && n_streams < MAX_STREAMS) s = &streams[n_streams++];
    if (s == NULL || s->handle == handle) {
        pthread_mutex_unlock(&mu);
        free(pend);
        free(held);
        return -1;
    }
    memset(s, 0, sizeof *s);
    s->handle = handle;
    if (handle > newest) newest = handle;
    s->rate = rate;
    s->frame = frame;
    s->loud = loud_ms * frame;
    s->pend = pend;
    s->hold = held;
    s->hold_cap = hold_frames;
    totals[T_STREAMS] += 1;
    pthread_mutex_unlock(&mu);
    return 0;
}

/* The session's ring (engine/link.py's layout, from the mapping's start `base`): frames from now on are
   written there, after what was held, their ends kept `lead_s` ahead of the engine's takes (`taken_at`'s
   offset; `lead_s` 0: where they fall). -1: no such stream. */
int pump_attach(uint64_t handle, void *base, int64_t in_w, int64_t in_r, int64_t frames_at, int64_t stamps_at,
                int64_t nframes, int frame, int64_t taken_at, double lead_s) {
    int rc = -1;
    pthread_mutex_lock(&mu);
    stream_t *s = find(handle);
    if (s != NULL && base != NULL && nframes > 0 && frame == s->frame) {
        uint8_t *b = base;
        s->in_w = (volatile int64_t *)(b + in_w);
        s->in_r = (volatile int64_t *)(b + in_r);
        s->frames = (int16_t *)(b + frames_at);
        s->stamps = (double *)(b + stamps_at);
        s->nframes = nframes;
        s->taken_at = (volatile double *)(b + taken_at);
        s->tick_s = (double)frame / s->rate;
        s->lead_s = lead_s;
        s->nleads = 0, s->drop = 0;
        s->w = __atomic_load_n(s->in_w, __ATOMIC_ACQUIRE); /* the room is the counter's one writer */
        while (s->hold_n > 0) {
            write_ring(s, s->hold + (size_t)s->hold_head * s->frame);
            s->hold_head = (s->hold_head + 1) % s->hold_cap;
            s->hold_n -= 1;
        }
        rc = 0;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* No ring any more (the session is closing; its memory is about to be unmapped): frames are held again. */
int pump_detach(uint64_t handle) {
    pthread_mutex_lock(&mu);
    stream_t *s = find(handle);
    if (s != NULL) s->frames = NULL, s->stamps = NULL, s->in_w = s->in_r = NULL, s->taken_at = NULL;
    pthread_mutex_unlock(&mu);
    return s != NULL ? 0 : -1;
}

int pump_stats(uint64_t handle, double *out, int n) {
    int rc = -1;
    pthread_mutex_lock(&mu);
    stream_t *s = find(handle);
    if (s != NULL && n >= N_STATS) {
        memcpy(out, s->stats, sizeof s->stats);
        rc = 0;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* The stream is gone: its entry is freed and a frame of it still in flight is dropped, not forwarded. */
int pump_unregister(uint64_t handle) {
    int16_t *pend = NULL, *held = NULL;
    pthread_mutex_lock(&mu);
    stream_t *s = find(handle);
    if (s != NULL) {
        pend = s->pend, held = s->hold;
        memset(s, 0, sizeof *s);
        while (n_streams > 0 && streams[n_streams - 1].handle == 0) n_streams--;
        tombstones[tomb_next] = handle;
        tomb_next = (tomb_next + 1) % TOMBSTONES;
    }
    pthread_mutex_unlock(&mu);
    free(pend);
    free(held);
    return s != NULL ? 0 : -1;
}

void pump_totals(uint64_t *out) {
    pthread_mutex_lock(&mu);
    memcpy(out, totals, sizeof totals);
    pthread_mutex_unlock(&mu);
}

int pump_n_stats(void) { return N_STATS; }
int pump_n_fields(void) { return N_FIELDS; }
