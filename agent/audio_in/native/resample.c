/* A streaming polyphase resampler for int16 mono audio at a rational ratio: the agent's frames from the
engine's rate (22.05 kHz) to its track's (48 kHz), made by the native library that captures them
(audio_pump.c), so no frame goes through a resampling request of the rtc runtime from Python.

The ratio is L/M (the rates over their greatest common divisor: 320/147 for 22,050 to 48,000 Hz). The filter is
a windowed sinc (Kaiser, beta 8: about 80 dB of stopband) of TAPS taps a phase, its cutoff at 0.91 of the
lower rate's Nyquist frequency, stored as L phases of TAPS coefficients each, every phase summing to 1 so a
constant passes unchanged. Output sample k lies at input position k*M/L; it is the dot product of phase
(k*M mod L) with the TAPS input samples ending at floor(k*M/L). A resampler keeps the last TAPS-1 input samples
and its position between calls, so a stream cut into frames of any length comes out as it would in one piece,
and an 80 ms frame at 22,050 Hz (1,764 samples) becomes exactly one of 3,840 at 48,000 Hz. The filter's delay
is TAPS/2 input samples (0.7 ms at 22,050 Hz). */

#include "resample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TAPS 32
#define KAISER_BETA 8.0
#define CUTOFF 0.91 /* of the lower rate's Nyquist frequency */

struct resampler {
    int in_rate, out_rate;
    int64_t L, M;
    float *coef;         /* [L][TAPS], each phase's taps newest input first */
    int16_t hist[TAPS - 1]; /* the last TAPS-1 input samples, oldest first */
    int64_t pos;         /* the next output's input position, in 1/L samples, from the first sample not yet in hist */
    int quiet;           /* hist holds only zeros */
    float *work;         /* hist and the input, as floats */
    int64_t work_n;
};

static int64_t gcd(int64_t a, int64_t b) {
    while (b) {
        int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static double bessel_i0(double x) { /* its power series, to double precision for x up to 20 */
    double sum = 1.0, term = 1.0, q = x * x / 4.0;
    for (int k = 1; k < 60; k++) {
        term *= q / ((double)k * k);
        sum += term;
        if (term < sum * 1e-17) break;
    }
    return sum;
}

resampler *rs_new(int in_rate, int out_rate) {
    if (in_rate <= 0 || out_rate <= 0) return NULL;
    int64_t g = gcd(in_rate, out_rate), L = out_rate / g, M = in_rate / g;
    if (L > 4096) return NULL; /* a ratio this fine would want a table too large */
    resampler *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->coef = malloc((size_t)L * TAPS * sizeof(float));
    if (r->coef == NULL) {
        free(r);
        return NULL;
    }
    r->in_rate = in_rate, r->out_rate = out_rate, r->L = L, r->M = M, r->quiet = 1;
    /* the prototype at L times the input rate: n = 0 .. L*TAPS-1, centred on (L*TAPS-1)/2 */
    double fc = CUTOFF * 0.5 * (in_rate < out_rate ? in_rate : out_rate) / ((double)L * in_rate);
    double centre = (L * TAPS - 1) / 2.0, i0b = bessel_i0(KAISER_BETA);
    for (int64_t p = 0; p < L; p++) {
        double sum = 0.0, h[TAPS];
        for (int m = 0; m < TAPS; m++) {
            double n = (double)(p + m * L), t = n - centre, u = 2.0 * n / (L * TAPS - 1) - 1.0;
            double sinc = t == 0.0 ? 2.0 * fc : sin(2.0 * M_PI * fc * t) / (M_PI * t);
            h[m] = sinc * bessel_i0(KAISER_BETA * sqrt(fmax(0.0, 1.0 - u * u))) / i0b;
            sum += h[m];
        }
        for (int m = 0; m < TAPS; m++) r->coef[p * TAPS + m] = (float)(h[m] / sum);
    }
    return r;
}

int rs_in_rate(const resampler *r) { return r->in_rate; }
int rs_out_rate(const resampler *r) { return r->out_rate; }

void rs_free(resampler *r) {
    if (r != NULL) {
        free(r->work);
        free(r->coef);
        free(r);
    }
}

int64_t rs_out_len(const resampler *r, int64_t n) {
    if (r->pos >= n * r->L) return 0;
    return (n * r->L - r->pos + r->M - 1) / r->M;
}

static int16_t to_i16(float v) {
    v = v >= 0.0f ? v + 0.5f : v - 0.5f;
    if (v > 32767.0f) return 32767;
    if (v < -32768.0f) return -32768;
    return (int16_t)v;
}

int64_t rs_run(resampler *r, const int16_t *in, int64_t n, int16_t *out) {
    int64_t made = rs_out_len(r, n);
    int loud = !r->quiet;
    for (int64_t i = 0; i < n && !loud; i++) loud = in[i] != 0;
    if (loud) {
        if (r->work_n < TAPS - 1 + n) { /* grown to the longest input seen, kept between calls */
            float *grown = realloc(r->work, (size_t)(TAPS - 1 + n) * sizeof(float));
            if (grown == NULL) return -1;
            r->work = grown, r->work_n = TAPS - 1 + n;
        }
        float *x = r->work; /* hist, then the input */
        for (int i = 0; i < TAPS - 1; i++) x[i] = r->hist[i];
        for (int64_t i = 0; i < n; i++) x[TAPS - 1 + i] = in[i];
        int64_t pos = r->pos;
        for (int64_t k = 0; k < made; k++, pos += r->M) {
            int64_t i = pos / r->L, p = pos % r->L;
            const float *c = r->coef + p * TAPS, *s = x + i + TAPS - 1; /* s[-m]: the input m samples back */
            float acc = 0.0f;
            for (int m = 0; m < TAPS; m++) acc += c[m] * s[-m];
            out[k] = to_i16(acc);
        }
    } else {
        memset(out, 0, (size_t)made * sizeof(int16_t)); /* silence in, silence out */
    }
    /* the last TAPS-1 samples of hist and input, and the position past what was consumed */
    if (n >= TAPS - 1) {
        memcpy(r->hist, in + n - (TAPS - 1), (TAPS - 1) * sizeof(int16_t));
    } else {
        memmove(r->hist, r->hist + n, (size_t)(TAPS - 1 - n) * sizeof(int16_t));
        memcpy(r->hist + TAPS - 1 - n, in, (size_t)n * sizeof(int16_t));
    }
    r->quiet = 1;
    for (int i = 0; i < TAPS - 1 && r->quiet; i++) r->quiet = r->hist[i] == 0;
    r->pos += made * r->M - n * r->L;
    return made;
}
