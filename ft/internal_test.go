package ft

import (
	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/coordinator/memcoord"
)

// onDriver runs f on c's driver goroutine; false once the driver ended.
func (c *Comm) onDriver(f func(*driver)) bool {
	in := inspect{f: f, done: make(chan struct{})}
	select {
	case c.in <- in:
	case <-c.done:
		return false
	}
	<-in.done
	return true
}

// current returns the comms of c's current epoch (zero while it has none).
func (c *Comm) current() stepComms {
	var s stepComms
	c.onDriver(func(d *driver) { s = d.stepComms() })
	return s
}

// ftData is the current FT data comm, nil when there is none.
func (c *Comm) ftData() *comm.Comm { return c.current().ft.data }

// joinAs registers ft member id ("<group>.<rank>") with coord.
func joinAs(coord *memcoord.Coordinator, id string, minReplicas int) *memcoord.Member {
	g, _, _ := parseMemberID(id)
	return coord.Join(id, g, minReplicas)
}
