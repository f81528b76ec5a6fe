/* What the native callback (audio_pump.c: the events, the caller's frames) and the agent's captures
(capture.c) share: the event's field numbers, one lock, the clock, protobuf's wire format and the runtime's
entry points. Internal to the library: nothing here is exported. */

#ifndef CHORUS_PUMP_H
#define CHORUS_PUMP_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define PUMP_INTERNAL __attribute__((visibility("hidden")))

typedef _Bool (*drop_fn)(uint64_t handle);
typedef uint64_t (*request_fn)(const uint8_t *data, size_t len, const uint8_t **res, size_t *res_len);

enum {
    F_EVENT_AUDIO,   /* FfiEvent.audio_stream_event */
    F_ASE_HANDLE,    /* AudioStreamEvent.stream_handle */
    F_ASE_FRAME,     /* AudioStreamEvent.frame_received */
    F_AFR_FRAME,     /* AudioFrameReceived.frame */
    F_BUF_HANDLE,    /* OwnedAudioFrameBuffer.handle */
    F_BUF_INFO,      /* OwnedAudioFrameBuffer.info */
    F_HANDLE_ID,     /* FfiOwnedHandle.id */
    F_INFO_PTR,      /* AudioFrameBufferInfo.data_ptr */
    F_INFO_CH,       /* AudioFrameBufferInfo.num_channels */
    F_INFO_RATE,     /* AudioFrameBufferInfo.sample_rate */
    F_INFO_SPC,      /* AudioFrameBufferInfo.samples_per_channel */
    F_EVENT_LOGS,    /* FfiEvent.logs */
    F_LB_RECORDS,    /* LogBatch.records */
    F_LR_LEVEL,      /* LogRecord.level */
    F_LR_TARGET,     /* LogRecord.target */
    V_LOG_DEBUG,     /* LogLevel.LOG_DEBUG's value */
    V_LOG_TRACE,     /* LogLevel.LOG_TRACE's value */
    V_RTC_DEBUG,     /* 1: LIVEKIT_RTC_DEBUG is on (the SDK then logs the runtime's debug records) */
    F_REQ_CAPTURE,   /* FfiRequest.capture_audio_frame */
    F_CAP_SOURCE,    /* CaptureAudioFrameRequest.source_handle */
    F_CAP_BUFFER,    /* CaptureAudioFrameRequest.buffer */
    F_CAP_ASYNC,     /* CaptureAudioFrameRequest.request_async_id */
    F_RESP_CAPTURE,  /* FfiResponse.capture_audio_frame */
    F_RESP_ASYNC,    /* CaptureAudioFrameResponse.async_id */
    F_EVENT_CAPTURE, /* FfiEvent.capture_audio_frame */
    F_CB_ASYNC,      /* CaptureAudioFrameCallback.async_id */
    F_CB_ERROR,      /* CaptureAudioFrameCallback.error */
    N_FIELDS
};

PUMP_INTERNAL extern int fields[N_FIELDS]; /* the numbers, from the SDK's own descriptors (pump_init) */
PUMP_INTERNAL extern pthread_mutex_t mu;   /* every table of the library */
PUMP_INTERNAL extern drop_fn drop_handle;  /* the native library's: drop an owned handle */
PUMP_INTERNAL extern request_fn ffi_request; /* the native library's: one request, answered at once */

PUMP_INTERNAL double now_s(void); /* CLOCK_MONOTONIC seconds, as Python's time.monotonic */
/* The next field of a message: its number, and either its varint value or its bytes (wire type 2). 0 at the
   end or on a malformed message. */
PUMP_INTERNAL int next_field(const uint8_t **p, const uint8_t *end, uint32_t *num, uint64_t *val,
                             const uint8_t **sub, size_t *sublen);
/* The bytes of field `want` (wire type 2) of a message; 0 if absent (the last occurrence wins). */
PUMP_INTERNAL int find_bytes(const uint8_t *p, size_t n, int want, const uint8_t **out, size_t *outlen);
/* A capture's callback event (capture.c): its copy freed and its track's counters moved. 0: not one of
   this library's captures (the SDK's own AudioSource's: Python's). */
PUMP_INTERNAL int capture_done(const uint8_t *cb, size_t cb_n);

#endif
