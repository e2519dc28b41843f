#include "textflag.h"

// func addF32AVX2(d, a, b *float32, n int)
// d[i] = a[i] + b[i] for i < n; n is a multiple of 32. d may alias a or b
// exactly: each block is loaded before it is stored.
TEXT ·addF32AVX2(SB), NOSPLIT, $0-32
	MOVQ d+0(FP), DI
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ n+24(FP), CX
	SHLQ $2, CX
	XORQ AX, AX
loop32:
	CMPQ AX, CX
	JAE  done32
	VMOVUPS (SI)(AX*1), Y0
	VMOVUPS 32(SI)(AX*1), Y1
	VMOVUPS 64(SI)(AX*1), Y2
	VMOVUPS 96(SI)(AX*1), Y3
	VADDPS  (DX)(AX*1), Y0, Y0
	VADDPS  32(DX)(AX*1), Y1, Y1
	VADDPS  64(DX)(AX*1), Y2, Y2
	VADDPS  96(DX)(AX*1), Y3, Y3
	VMOVUPS Y0, (DI)(AX*1)
	VMOVUPS Y1, 32(DI)(AX*1)
	VMOVUPS Y2, 64(DI)(AX*1)
	VMOVUPS Y3, 96(DI)(AX*1)
	ADDQ    $128, AX
	JMP     loop32
done32:
	VZEROUPPER
	RET

// func addF64AVX2(d, a, b *float64, n int)
// The same for float64; n is a multiple of 16.
TEXT ·addF64AVX2(SB), NOSPLIT, $0-32
	MOVQ d+0(FP), DI
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ n+24(FP), CX
	SHLQ $3, CX
	XORQ AX, AX
loop64:
	CMPQ AX, CX
	JAE  done64
	VMOVUPD (SI)(AX*1), Y0
	VMOVUPD 32(SI)(AX*1), Y1
	VMOVUPD 64(SI)(AX*1), Y2
	VMOVUPD 96(SI)(AX*1), Y3
	VADDPD  (DX)(AX*1), Y0, Y0
	VADDPD  32(DX)(AX*1), Y1, Y1
	VADDPD  64(DX)(AX*1), Y2, Y2
	VADDPD  96(DX)(AX*1), Y3, Y3
	VMOVUPD Y0, (DI)(AX*1)
	VMOVUPD Y1, 32(DI)(AX*1)
	VMOVUPD Y2, 64(DI)(AX*1)
	VMOVUPD Y3, 96(DI)(AX*1)
	ADDQ    $128, AX
	JMP     loop64
done64:
	VZEROUPPER
	RET
