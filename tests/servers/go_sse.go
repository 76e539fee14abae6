// The matrix's Go server: net/http streaming OpenAI chat-completions SSE, one
// Flush per chunk. Plain HTTP/1.1, or with -cert/-key crypto/tls, where
// net/http offers HTTP/2 (ALPN h2) beside HTTP/1.1 without any other module.
// Built by the tests with `go build` from Debian's golang-go; standard library only.
//
// Run: go_sse -port PORT [-cert CERT -key KEY]
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net/http"
	"strings"
	"time"
)

type message struct {
	Content string `json:"content"`
}

type request struct {
	Model         string    `json:"model"`
	MaxTokens     int       `json:"max_tokens"`
	Messages      []message `json:"messages"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

func chat(w http.ResponseWriter, r *http.Request) {
	var req request
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	prompt := 0
	for _, m := range req.Messages {
		prompt += len(strings.Fields(m.Content))
	}
	id := fmt.Sprintf("chatcmpl-go-%d", time.Now().UnixNano())
	flusher := w.(http.Flusher)
	w.Header().Set("Content-Type", "text/event-stream")
	send := func(obj map[string]any) {
		obj["id"], obj["object"], obj["model"] = id, "chat.completion.chunk", req.Model
		data, _ := json.Marshal(obj)
		fmt.Fprintf(w, "data: %s\n\n", data)
		flusher.Flush()
		time.Sleep(10 * time.Millisecond) // llm_script.py's FRAME_GAP_S
	}
	choice := func(delta map[string]any, finish any) map[string]any {
		return map[string]any{"choices": []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish}}}
	}
	send(choice(map[string]any{"role": "assistant", "content": ""}, nil))
	for i := 0; i < req.MaxTokens; i++ {
		send(choice(map[string]any{"content": fmt.Sprintf(" tok%d", i)}, nil))
	}
	send(choice(map[string]any{}, "length"))
	if req.StreamOptions.IncludeUsage {
		send(map[string]any{"choices": []any{}, "usage": map[string]int{
			"prompt_tokens": prompt, "completion_tokens": req.MaxTokens, "total_tokens": prompt + req.MaxTokens}})
	}
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func main() {
	port := flag.Int("port", 0, "port on 127.0.0.1")
	cert := flag.String("cert", "", "TLS certificate (PEM)")
	key := flag.String("key", "", "TLS key (PEM)")
	flag.Parse()
	http.HandleFunc("/v1/chat/completions", chat)
	addr := fmt.Sprintf("127.0.0.1:%d", *port)
	if *cert != "" {
		log.Fatal(http.ListenAndServeTLS(addr, *cert, *key, nil))
	}
	log.Fatal(http.ListenAndServe(addr, nil))
}
