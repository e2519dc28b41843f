package gloo

import (
	"context"

	"github.com/ftcomm/ftcomm/comm"
)

// ---- point to point ----

func p2pDesc(t comm.Tensor) desc {
	return desc{op: comm.OpSend, dtype: t.DType(), root: -1, count: uint64(t.Count())}
}

// Send implements comm.Backend. It returns once the data is in the kernel's
// socket buffers (for messages larger than those, once the peer receives).
func (b *Backend) Send(ctx context.Context, t comm.Tensor, peer int) error {
	if err := b.begin(ctx, comm.OpSend); err != nil {
		return err
	}
	l := b.links[peer]
	seq := l.p2pTx
	l.p2pTx++
	return b.end(b.sendMessage(ctx, peer, seq, t))
}

// Recv implements comm.Backend.
func (b *Backend) Recv(ctx context.Context, t comm.Tensor, peer int) error {
	if err := b.begin(ctx, comm.OpRecv); err != nil {
		return err
	}
	l := b.links[peer]
	seq := l.p2pRx
	l.p2pRx++
	_, done := b.post(peer, entry{seq: seq, d: p2pDesc(t), mode: modeCopy, dst: t.Bytes()})
	return b.end(b.waitRx(ctx, peer, 0, done))
}

// BatchP2P implements comm.Backend: all receives are posted, then the sends
// go out in order, then it waits for the receives.
func (b *Backend) BatchP2P(ctx context.Context, ops []comm.P2POp) error {
	if err := b.begin(ctx, comm.OpBatchP2P); err != nil {
		return err
	}
	for _, o := range ops {
		if o.Kind == comm.P2PRecv {
			l := b.links[o.Peer]
			b.post(o.Peer, entry{seq: l.p2pRx, d: p2pDesc(o.Tensor), mode: modeCopy, dst: o.Tensor.Bytes()})
			l.p2pRx++
		}
	}
	for _, o := range ops {
		if o.Kind == comm.P2PSend {
			l := b.links[o.Peer]
			seq := l.p2pTx
			l.p2pTx++
			if err := b.sendMessage(ctx, o.Peer, seq, o.Tensor); err != nil {
				return b.end(err)
			}
		}
	}
	return b.end(b.waitAll(ctx))
}
