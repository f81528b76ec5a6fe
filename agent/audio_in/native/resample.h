/* A streaming polyphase resampler for int16 mono audio at a rational ratio (resample.c). */
#ifndef CHORUS_RESAMPLE_H
#define CHORUS_RESAMPLE_H

#include <stdint.h>

typedef struct resampler resampler;

/* A resampler from in_rate to out_rate; NULL when the ratio is too fine (its L over 4096) or no memory. */
resampler *rs_new(int in_rate, int out_rate);
void rs_free(resampler *r);
int rs_in_rate(const resampler *r);
int rs_out_rate(const resampler *r);
/* How many samples `rs_run` makes of n input samples now (at most n*L/M + 1). */
int64_t rs_out_len(const resampler *r, int64_t n);
/* n input samples in; rs_out_len(r, n) samples out (`out` must hold them). Returns that count, or -1 (no
   memory: nothing consumed). One thread at a time per resampler. */
int64_t rs_run(resampler *r, const int16_t *in, int64_t n, int16_t *out);

#endif
