package reduce_test

import (
	"fmt"

	"github.com/ftcomm/ftcomm/comm"
	"github.com/ftcomm/ftcomm/comm/reduce"
)

func Example() {
	acc := []float32{1, 2, 3}
	in := []float32{10, 20, 30}
	reduce.Into(comm.Float32, comm.Avg, comm.Float32s(acc).Bytes(), comm.Float32s(in).Bytes())
	reduce.Divide(comm.Float32, comm.Float32s(acc).Bytes(), 2) // two contributions
	fmt.Println(acc)
	// Output: [5.5 11 16.5]
}
