/* The fixed tree that ends every 16-lane reduction of the kernels (the consumers' dot products,
 * the softmax's sums): lane j + lane j+8, then j + j+4, then j + j+2, then j + j+1. It is also
 * what halving an AVX-512 register computes, so every path reduces in this order. */
#ifndef KVQ_TREE16_H
#define KVQ_TREE16_H

static inline float kvq_tree16(const float a[16])
{
    float s8[8], s4[4], s2[2];
    int j;
    for (j = 0; j < 8; j++) s8[j] = a[j] + a[j + 8];
    for (j = 0; j < 4; j++) s4[j] = s8[j] + s8[j + 4];
    for (j = 0; j < 2; j++) s2[j] = s4[j] + s4[j + 2];
    return s2[0] + s2[1];
}

#endif /* KVQ_TREE16_H */
