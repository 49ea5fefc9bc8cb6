#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ __inline__ __attribute__((always_inline))
#include "__clang_cuda_builtin_vars.h"
__device__ float __int_as_float(int);
__device__ float __uint_as_float(unsigned int);
__device__ unsigned int __float_as_uint(float);
__device__ long long __double_as_longlong(double);
__device__ double __longlong_as_double(long long);
__device__ double fma(double, double, double);
__device__ float __shfl_xor_sync(unsigned, float, int);
__device__ double __shfl_xor_sync(unsigned, double, int);
__device__ int __shfl_xor_sync(unsigned, int, int);
__device__ float expf(float); __device__ float logf(float); __device__ float sinf(float);
__device__ float cosf(float); __device__ float sqrtf(float); __device__ float fmaf(float,float,float);
__device__ float fminf(float,float); __device__ float fmaxf(float,float);
__device__ void __syncthreads(); __device__ void __syncwarp(unsigned m = 0xffffffffu);
__device__ float __shfl_sync(unsigned, float, int);
__device__ int __shfl_sync(unsigned, int, int);
__device__ float fabsf(float); __device__ float rintf(float); __device__ double exp(double);
__device__ int __dp4a(int, int, int); __device__ unsigned int __byte_perm(unsigned int, unsigned int, unsigned int); __device__ int atomicAdd(int*, int);
__device__ unsigned int atomicInc(unsigned int*, unsigned int); __device__ void __threadfence();
