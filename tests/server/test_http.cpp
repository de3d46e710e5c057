// The HTTP layer over real sockets: framing of fixed and chunked responses, keep-alive, limits answered with
// OpenAI error JSON, Expect: 100-continue, disconnect detection, and shutdown.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "server/http.h"
#include "server/socket_client.h"

namespace lily {
namespace {

using Clock = std::chrono::steady_clock;

class HttpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    HttpServerOptions o;
    o.port = 0;
    o.max_body_bytes = 1000;
    o.max_header_bytes = 2000;
    server_ = std::make_unique<HttpServer>(
        o, [this](const HttpRequest& req, HttpExchange& ex) { handle(req, ex); });
    ASSERT_TRUE(server_->listen().ok());
    thread_ = std::thread([this] { server_->run(); });
  }
  void TearDown() override {
    server_->shutdown();
    thread_.join();
  }
  void handle(const HttpRequest& req, HttpExchange& ex) {
    if (req.path == "/echo") return ex.send(200, "text/plain", req.method + " " + req.body + " " + req.query);
    if (req.path == "/stream") {
      ex.begin_stream(200, "text/event-stream");
      ex.write("a");
      ex.write("bc");
      return ex.end_stream();
    }
    if (req.path == "/wait-gone") {
      ex.begin_stream(200, "text/event-stream");
      ex.write("started");
      auto deadline = Clock::now() + std::chrono::seconds(5);
      while (!ex.client_gone() && Clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      gone_at_ = Clock::now();
      detected_ = ex.client_gone();
      return ex.abandon();
    }
    ex.send(404, "text/plain", "no");
  }

  std::unique_ptr<HttpServer> server_;
  std::thread thread_;
  std::atomic<bool> detected_{false};
  Clock::time_point gone_at_;
};

TEST_F(HttpTest, FixedLengthResponsesOverOneKeptAliveConnection) {
  Client c(server_->port());
  ASSERT_TRUE(
      c.send("POST /echo?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
             "GET /ec%68o HTTP/1.1\r\nHost: a\r\n\r\n"));
  EXPECT_EQ(c.read_until("x=1"),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 14\r\n\r\nPOST hello x=1");
  EXPECT_EQ(c.read_until("GET  "),
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nGET  ");
}

TEST_F(HttpTest, ChunkedStreamBytes) {
  Client c(server_->port());
  ASSERT_TRUE(c.send("GET /stream HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"));
  EXPECT_EQ(c.read_all(),
            "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            "Connection: close\r\n\r\n1\r\na\r\n2\r\nbc\r\n0\r\n\r\n");
}

TEST_F(HttpTest, OversizedBodyGets413AfterTheClientSentIt) {
  Client c(server_->port());
  std::string body(200000, 'x');
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 200000\r\n\r\n"));
  c.send(body);  // the server reads and discards it so that the client sees the answer, not a reset
  std::string r = c.read_all();
  EXPECT_TRUE(r.starts_with("HTTP/1.1 413 Payload Too Large\r\n")) << r;
  EXPECT_NE(r.find(R"({"error":{"message":"request body of 200000 bytes exceeds the limit of 1000 bytes",)"
                   R"("type":"invalid_request_error","param":null,"code":null}})"),
            std::string::npos)
      << r;
}

TEST_F(HttpTest, MalformedRequestsAndLimits) {
  {
    Client c(server_->port());
    c.send("NONSENSE\r\n\r\n");
    EXPECT_TRUE(c.read_all().starts_with("HTTP/1.1 400 Bad Request\r\n"));
  }
  {
    Client c(server_->port());
    c.send("GET / HTTP/1.1\r\nX-Big: " + std::string(3000, 'a') + "\r\n\r\n");
    EXPECT_TRUE(c.read_all().starts_with("HTTP/1.1 431 "));
  }
  {
    Client c(server_->port());
    c.send(
        "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\nConnection: "
        "close\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
    EXPECT_TRUE(c.read_all().ends_with("\r\n\r\nPOST hello "));  // chunked bodies are decoded
  }
  {
    Client c(server_->port());
    c.send("POST /echo HTTP/1.1\r\nContent-Length: 12x\r\n\r\n");
    EXPECT_TRUE(c.read_all().starts_with("HTTP/1.1 400 "));
  }
}

TEST_F(HttpTest, ExpectContinue) {
  Client c(server_->port());
  ASSERT_TRUE(c.send("POST /echo HTTP/1.1\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"));
  EXPECT_EQ(c.read_until("\r\n\r\n"), "HTTP/1.1 100 Continue\r\n\r\n");
  ASSERT_TRUE(c.send("abc"));
  EXPECT_NE(c.read_until("POST abc ").find("200 OK"), std::string::npos);
}

TEST_F(HttpTest, DisconnectIsNoticedPromptly) {
  Client c(server_->port());
  ASSERT_TRUE(c.send("GET /wait-gone HTTP/1.1\r\n\r\n"));
  c.read_until("started");
  auto closed_at = Clock::now();
  c.close();
  for (int i = 0; i < 500 && !detected_.load(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(detected_.load());
  EXPECT_LT(std::chrono::duration<double>(gone_at_ - closed_at).count(), 0.5);
}

TEST(HttpServerLifecycle, ShutdownClosesIdleConnectionsAndRunReturns) {
  HttpServerOptions o;
  o.port = 0;
  HttpServer server(o, [](const HttpRequest&, HttpExchange& ex) { ex.send(200, "text/plain", "ok"); });
  ASSERT_TRUE(server.listen().ok());
  std::thread t([&] { server.run(); });
  Client c(server.port());
  c.send("GET / HTTP/1.1\r\n\r\n");
  EXPECT_NE(c.read_until("ok").find("200 OK"), std::string::npos);
  EXPECT_EQ(server.connections(), 1u);  // kept alive
  auto t0 = Clock::now();
  server.shutdown();
  t.join();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 2.0);
  EXPECT_EQ(server.connections(), 0u);
  EXPECT_EQ(c.read_all(), "");  // closed by the server
}

TEST(HttpServerLifecycle, BusyConnectionsAreCutAfterTheDrainTimeout) {
  HttpServerOptions o;
  o.port = 0;
  o.drain_timeout_ms = 200;
  std::atomic<bool> handler_done{false};
  HttpServer server(o, [&](const HttpRequest&, HttpExchange& ex) {
    ex.begin_stream(200, "text/plain");
    ex.write("working");
    auto deadline = Clock::now() + std::chrono::seconds(20);  // a handler that would outlive the server
    while (!ex.client_gone() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ex.abandon();
    handler_done = true;
  });
  ASSERT_TRUE(server.listen().ok());
  std::thread t([&] { server.run(); });
  Client c(server.port());
  c.send("GET / HTTP/1.1\r\n\r\n");
  c.read_until("working");
  auto t0 = Clock::now();
  server.shutdown();
  t.join();
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_GE(took, 0.15);
  EXPECT_LT(took, 2.0);
  EXPECT_TRUE(handler_done.load());
  EXPECT_EQ(server.connections(), 0u);
}

TEST(HttpServerLifecycle, PortInUseIsAnError) {
  HttpServerOptions o;
  o.port = 0;
  HttpServer a(o, [](const HttpRequest&, HttpExchange&) {});
  ASSERT_TRUE(a.listen().ok());
  o.port = a.port();
  HttpServer b(o, [](const HttpRequest&, HttpExchange&) {});
  Status st = b.listen();
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(std::to_string(a.port())), std::string::npos) << st.message();
}

}  // namespace
}  // namespace lily
