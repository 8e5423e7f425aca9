// Loops built several times, for AVX-512, for AVX2 and for the x86-64 baseline, with the copy
// picked when the program loads (GCC's target_clones). The project builds without contraction
// (-ffp-contract=off) and every lane op is the same IEEE operation at any vector width, so all
// copies give the same bits; only loops whose order of operations is fixed by the source (no
// reassociation) go here.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define TANDEM_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TANDEM_CPU_CLONES
#endif
