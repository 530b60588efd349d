/* The CUDA quantize kernel's division-free quotient (csrc/kernels.cu, quantize_code_fast),
 * checked against a true division on random operands:
 *   r = RN(1/b), q0 = RN(a*r), q = fma(fma(-q0, b, a), r, q0)
 * must equal RN(a/b) whenever a >= 2**-100 and the quotient is normal, and the code
 * floor(RN(q + u)) must always equal the division's, for b a bfloat16 value in
 * [2**-60, 2**60] and a in [0, 300 b). Usage: division_free_quotient SAMPLES SEED.
 * Exit status 0 when all agree. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t state;
static uint64_t next(void) {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}

static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

int main(int argc, char** argv) {
  long samples = argc > 1 ? atol(argv[1]) : 1000000;
  state = argc > 2 ? strtoull(argv[2], NULL, 10) | 1u : 88172645463325252ull;
  long quotients = 0, codes = 0;
  for (long i = 0; i < samples; ++i) {
    uint64_t w = next();
    float b = ldexpf(1.0f + (float)((w >> 8) & 0x7F) / 128.0f, (int)(w % 121) - 60);
    uint64_t z = next();
    float a;
    switch (z % 4) {
      case 0: { /* next to a multiple of the step */
        uint32_t bits;
        float t = b * (float)((z >> 20) % 256);
        memcpy(&bits, &t, 4);
        a = from_bits(bits + (uint32_t)((z >> 40) % 7) - 3u);
        if (!(a >= 0.0f)) a = 0.0f;
        break;
      }
      case 1: /* any bit pattern, folded into the group's range */
        a = fmodf(from_bits((uint32_t)(z >> 33) & 0x7F7FFFFFu), b * 300.0f);
        break;
      default: /* uniform in the group's range */
        a = (float)((double)(z >> 11) / 9007199254740992.0 * (double)(b * 255.0f));
    }
    float r = 1.0f / b;
    float q0 = a * r;
    float q = fmaf(fmaf(-q0, b, a), r, q0);
    float exact = a / b;
    if (a >= 0x1p-100f && exact >= 0x1p-126f && q != exact) {
      if (quotients++ < 5) printf("quotient a=%a b=%a: %a, division %a\n", a, b, q, exact);
    }
    float u = (float)(next() >> 40) * 5.9604644775390625e-08f;
    if (floorf(q + u) != floorf(exact + u)) {
      if (codes++ < 5) printf("code a=%a b=%a u=%a\n", a, b, u);
    }
  }
  printf("%ld samples: %ld quotients and %ld codes differ\n", samples, quotients, codes);
  return quotients || codes;
}
