package httpstore_test

import (
	"context"
	"fmt"

	"github.com/ftcomm/ftcomm/comm/httpstore"
)

func Example() {
	ctx := context.Background()
	srv, err := httpstore.Listen("127.0.0.1:0", httpstore.Config{}) // on rank 0
	if err != nil {
		panic(err)
	}
	defer srv.Close()
	st := httpstore.NewClient(srv.Addr(), httpstore.Config{}) // on every rank
	defer st.Close()
	st.Set(ctx, "job/epoch/0/addr/1", []byte("10.0.0.2:4000"))
	v, _ := st.Get(ctx, "job/epoch/0/addr/1")
	fmt.Println(string(v))
	// Output: 10.0.0.2:4000
}
