// MLX-compatible affine quantization (docs/MODEL.md 2.4): groups of 64 along the last (input) axis,
// w = scale * q + bias with q unsigned, scales may be negative. Packing: uint32 words, element k of a word at
// bits [k*bits, (k+1)*bits), LSB first (4-bit: 8 per word, 8-bit: 4 per word). Scales and biases are bf16.
#pragma once
#include <cstdint>

namespace lily {

constexpr int kQuantGroup = 64;

inline int64_t packed_words(int64_t cols, int bits) { return cols * bits / 32; }

// Quantizes rows x cols floats exactly as MLX's CPU `quantize` does (rint, the negated-scale edge rule, the
// edge snap), writing packed words [rows, cols*bits/32] and bf16 scales/biases [rows, cols/64].
void mlx_quantize(const float* w, int64_t rows, int64_t cols, int bits, uint32_t* wq, uint16_t* scales,
                  uint16_t* biases);

// Dequantizes one row of `cols` values (w = scale*q + bias in fp32, scale/bias from bf16).
void mlx_dequantize_row(const uint32_t* wq_row, const uint16_t* scales_row, const uint16_t* biases_row,
                        int64_t cols, int bits, float* out);

// Dot product of one quantized row with a float vector, without materialising the row.
float mlx_dot_row(const uint32_t* wq_row, const uint16_t* scales_row, const uint16_t* biases_row, int64_t cols,
                  int bits, const float* x);

// For a row dotted with many vectors: its codes as floats (exact), unpacked once, and mlx_dot_row's arithmetic
// over them, operation for operation, so the result is mlx_dot_row's bit for bit.
void mlx_unpack_codes(const uint32_t* wq_row, int64_t cols, int bits, float* codes);
float mlx_dot_codes(const float* codes, const uint16_t* scales_row, const uint16_t* biases_row, int64_t cols,
                    int bits, const float* x);

}  // namespace lily
