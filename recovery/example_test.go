package recovery_test

import (
	"context"
	"fmt"

	"github.com/ftcomm/ftcomm/recovery"
)

func Example() {
	ctx := context.Background()
	secret := []byte("job secret")
	// Two healthy replicas offer the committed state of step 120.
	params := []byte("the weights after step 120")
	var sources []string
	for range 2 {
		s, err := recovery.NewServer(recovery.ServerConfig{Job: "demo", Secret: secret})
		if err != nil {
			panic(err)
		}
		defer s.Close()
		s.Offer(120, []recovery.Blob{{Name: "params", Data: params}})
		sources = append(sources, s.Addr())
	}
	// A restarted replica heals from both.
	mine := []recovery.Blob{{Name: "params", Data: make([]byte, len(params))}}
	st, err := recovery.Fetch(ctx, recovery.DefaultFetchConfig("demo", secret), 120, sources, mine)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s (%d bytes)\n", mine[0].Data, st.Bytes)
	// Output: the weights after step 120 (26 bytes)
}
